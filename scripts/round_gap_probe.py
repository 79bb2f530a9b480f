"""Where plain decoding's time per token goes beyond the replayed step: end-to-end ms per token, the step
alone (graph replays back to back), and per round the host's own time against its wait for the GPU.

    python scripts/round_gap_probe.py --synthetic llama-1b [--methods none,draft] [--tokens 128]

A round waits in `_read_round` (the readout's copy) for the GPU; the rest of the loop is host work. When
the wait is near zero the host is the bottleneck; when the host's time is far below the step, the GPU is.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT_TOKENS = 40


def step_ms(target, repeats: int = 200) -> float:
    """One replayed block of one token after the prompt, back to back (profile_step's timing)."""
    import torch
    from profile_step import replay_ms  # scripts/ is this script's first import path

    target.reset()
    target.forward(torch.arange(3, 3 + PROMPT_TOKENS, device=target.device) % target.vocab_size)
    ms = replay_ms(target, torch.tensor([7], device=target.device), repeats, PROMPT_TOKENS, warmups=5)
    target.reset()
    return ms


def timed_generation(decoder, method: str, tokens: int) -> dict:
    """One generation with the round loop's wait for the GPU (inside _read_round) timed apart."""
    from engine.config import GenerationConfig
    from engine.decoder import SpeculativeDecoder

    waits = []
    original = SpeculativeDecoder._read_round

    def timed(self, *args, **kw):
        t0 = time.perf_counter()
        out = original(self, *args, **kw)
        waits.append(time.perf_counter() - t0)
        return out

    SpeculativeDecoder._read_round = timed
    try:
        config = GenerationConfig(method=method, k=4, max_new_tokens=tokens, stop_at_eos=False)
        prompt = " ".join(str(i) for i in range(PROMPT_TOKENS // 2))
        stamps, emitted = [], 0
        for event in decoder.generate(prompt, config):
            stamps.append(time.perf_counter())
            emitted += len(event.emitted_ids)
    finally:
        SpeculativeDecoder._read_round = original
    skip = min(4, len(stamps) - 2)  # the first rounds: prefill and captures
    span = stamps[-1] - stamps[skip]
    rounds = len(stamps) - 1 - skip
    wait = sum(waits[skip + 1:])
    return {"method": method, "rounds": len(stamps), "tokens": emitted,
            "ms_per_round": 1e3 * span / rounds, "wait_ms_per_round": 1e3 * wait / rounds,
            "host_ms_per_round": 1e3 * (span - wait) / rounds}


def main() -> int:
    import os

    import torch

    from engine.decoder import SpeculativeDecoder
    from engine.synthetic import build_synthetic_pair

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic", default="llama-1b")
    parser.add_argument("--methods", default="none,draft")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: round_gap_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    pair = build_synthetic_pair(args.synthetic, torch.device("cuda"), torch.bfloat16).pair
    decoder = SpeculativeDecoder(pair)
    decoder.warm_up()
    with torch.inference_mode():
        print(f"{args.synthetic}: SPECPLAY_PDL={os.environ.get('SPECPLAY_PDL', '1')}; replayed step "
              f"{step_ms(pair.target):.3f} ms")
        for method in args.methods.split(","):
            for _ in range(args.repeats):
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                  for k, v in timed_generation(decoder, method, args.tokens).items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
