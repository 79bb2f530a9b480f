"""Where the first event of a generation goes: `bench runtimes`' time to first token taken apart.

    python scripts/ttft_probe.py --synthetic llama-1b [--method none] [--prompts 4]

For each held-out prompt (after the same warm-up as `bench runtimes`): the time to the first event, the
prefill forward alone on that prompt (twice: first and again), and, for the last prompt, the host functions
of its first event by own time (cProfile) and the kernels it ran (torch.profiler).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from profile_e2e import _sync, prefill_ms  # noqa: E402  (scripts/ is this script's first import path)


def first_event_ms(decoder, prompt: str, config) -> float:
    _sync(decoder.device)
    began = time.perf_counter()
    events = decoder.generate(prompt, config)
    next(events)
    _sync(decoder.device)
    elapsed = 1000.0 * (time.perf_counter() - began)
    events.close()
    return elapsed


def main() -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import bench
    from engine.config import GenerationConfig
    from engine.decoder import SpeculativeDecoder
    from engine.runtimes import WARM_UP_PROMPT
    from engine.synthetic import build_synthetic_pair

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic", default="llama-1b")
    parser.add_argument("--method", default="none")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--top", type=int, default=22)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()

    built = build_synthetic_pair(args.synthetic, args.device,
                                 torch.bfloat16 if args.device == "cuda" else torch.float32)
    decoder = SpeculativeDecoder(built.pair)
    decoder.warm_up()
    config = GenerationConfig(method=args.method, k=4, max_new_tokens=128)
    prompts = bench.heldout_prompts(args.prompts)
    with torch.inference_mode():
        list(decoder.generate(WARM_UP_PROMPT, config))
        for prompt in prompts:
            ids = decoder._encode(prompt)
            first = first_event_ms(decoder, prompt, config)
            again = first_event_ms(decoder, prompt, config)
            fills = [prefill_ms(decoder.target, len(ids) - 1) for _ in range(2)]
            print(f"{len(ids):4d} prompt tokens: first event {first:7.2f} ms, again {again:7.2f} ms; "
                  f"prefill alone {fills[0]:6.2f} / {fills[1]:6.2f} ms")
        fresh = prompts[-1] + "\n    # one more line"
        profiler = cProfile.Profile()
        profiler.enable()
        ms = first_event_ms(decoder, fresh, config)
        profiler.disable()
        tokens = len(decoder._encode(fresh))
        print(f"\nfirst event of a new prompt ({tokens} tokens): {ms:.2f} ms; host functions:")
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[-4000:])
        fresh2 = prompts[0] + "\n    # another line"
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ms = first_event_ms(decoder, fresh2, config)
        print(f"\nfirst event of another new prompt: {ms:.2f} ms (profiled); kernels and host ops:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top,
                                        max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
