"""Where a generation's time goes on the GPU, end to end: the prefill of a new prompt length against one seen
before, and a method's decode loop as wall clock per round beside the GPU's busy time per round (the kernels
that ran and the host functions that took longest).

    python scripts/profiling/profile_e2e.py --synthetic llama-1b|shipped [--methods none,draft] [--tokens 128]

GPU busy below the wall clock means the host is the bound; equal means the kernels are.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PROMPT = "import os\n\n\ndef walk(path):\n    "


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def prefill_ms(target, length: int) -> float:
    import torch

    tokens = torch.arange(7, 7 + length, device=target.device) % target.vocab_size
    target.reset()
    _sync(target.device)
    began = time.perf_counter()
    target.forward(tokens)
    _sync(target.device)
    return 1000.0 * (time.perf_counter() - began)


def report_prefill(target, top: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        for length in (19, 27, 38):
            first, again = prefill_ms(target, length), prefill_ms(target, length)
            print(f"prefill of {length} tokens: first {first:.2f} ms, again {again:.2f} ms")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            prefill_ms(target, 53)
    _print_profile(prof, 1, top, "a first prefill of 53 tokens")


def _print_profile(prof, per: int, top: int, what: str) -> None:
    events = prof.key_averages()
    gpu = sorted((e for e in events if e.device_type.name == "CUDA"), key=lambda e: -e.device_time_total)
    busy = sum(e.device_time_total for e in gpu) / per
    kernels = sum(e.count for e in gpu) / per
    print(f"  {what}: GPU busy {busy / 1000:.3f} ms in {kernels:.0f} kernels per unit")
    for e in gpu[:top]:
        print(f"    {e.device_time_total / per:9.1f} us  x{e.count / per:<6.1f} {e.key[:90]}")
    cpu = sorted((e for e in events if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)
    print("  host ops by self time:")
    for e in cpu[:top]:
        print(f"    {e.self_cpu_time_total / per:9.1f} us  x{e.count / per:<6.1f} {e.key[:90]}")


def report_batch(target, batch: int, top: int, prompt: int = 64, steps: int = 10, timeline: int = 0) -> None:
    """One batched step (engine.models.batch_runner) of `batch` sequences, blocks of 1 and of 5 tokens, after
    `prompt` cached rows each: its time (graph replay, wall clock), its kernels, and (timeline) its last
    kernels in order."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine.models.batch_runner import BatchRunner

    runner = BatchRunner(target, batch, max_length=prompt + 128)
    device = target.device
    with torch.inference_mode():
        runner.forward(torch.arange(prompt, device=device).repeat(batch, 1) % target.vocab_size,
                       with_logits=False)
        for n in (1, 5):
            block = torch.ones(batch, n, dtype=torch.long, device=device)

            def step(block=block):
                runner.forward(block)
                runner.set_lengths([prompt] * batch)

            for _ in range(3):
                step()
            _sync(device)
            began = time.perf_counter()
            for _ in range(steps):
                step()
            _sync(device)
            print(f"== batched step B={batch} n={n}: {1000 * (time.perf_counter() - began) / steps:.3f} ms")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    step()
                _sync(device)
            _print_profile(prof, steps, top, "per step")
            if timeline:
                print_timeline(prof, timeline)
    runner.release_graphs()


def print_timeline(prof, last: int) -> None:
    """The profiled run's last `last` kernels in order: each one's start and end, and its phase, the time from
    the end of the kernel before to its own end (a programmatic launch starts early and waits, so a kernel's
    own duration overlaps its predecessor's; the phases add up to the span)."""
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                     key=lambda e: e.time_range.start)
    tail = kernels[-last:]
    if not tail:
        return
    first = tail[0].time_range.start
    print(f"  the last {len(tail)} kernels (us after the first one's start: start, end, phase):")
    previous_end = 0.0
    for e in tail:
        start, end = e.time_range.start - first, e.time_range.end - first
        print(f"    {start:9.1f} {end:9.1f} {end - previous_end:8.1f}  {e.name[:70]}")
        previous_end = max(previous_end, end)
    print(f"  their span {tail[-1].time_range.end - first:.1f} us")


def report_loop(decoder, method: str, tokens: int, top: int, acceptance: str = "", timeline: int = 0) -> None:
    from torch.profiler import ProfilerActivity, profile

    from engine.config import GenerationConfig
    from engine.methods.registry import parse_spec

    spec = parse_spec(method)  # a name, or NAME:N for a tree of N nodes
    config = GenerationConfig(method=spec.name, tree_nodes=spec.tree_nodes, k=4, max_new_tokens=tokens,
                              stop_at_eos=False,
                              synthetic_acceptance=acceptance if spec.name != "none" else "")
    list(decoder.generate(PROMPT, config))
    _sync(decoder.device)
    began = time.perf_counter()
    events = list(decoder.generate(PROMPT, config))
    _sync(decoder.device)
    wall = 1000.0 * (time.perf_counter() - began)
    rounds = len(events)
    made = sum(len(e.emitted_ids) for e in events)
    print(f"== {method}: {rounds} rounds, {made} tokens, {wall / made:.3f} ms/token end to end, "
          f"{wall / rounds:.3f} ms/round")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        list(decoder.generate(PROMPT, config))
        _sync(decoder.device)
    _print_profile(prof, rounds, top, "per round")
    if timeline:
        print_timeline(prof, timeline)
    host = cProfile.Profile()
    host.enable()
    list(decoder.generate(PROMPT, config))
    _sync(decoder.device)
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(top)
    print("  host functions (cProfile, whole generation):")
    print("\n".join("    " + line for line in text.getvalue().splitlines()[6:] if line.strip()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synthetic", default="llama-1b", help="a synthetic shape, or 'shipped' for the "
                        "shipped pair")
    parser.add_argument("--no-prefill", dest="prefill", action="store_false", help="skip the prefill report")
    parser.add_argument("--methods", default="none,draft")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--batch", type=int, default=0, help="also profile one batched step of this many")
    parser.add_argument("--prompt", type=int, default=64, help="cached rows a sequence before the batched "
                        "step (--batch)")
    parser.add_argument("--timeline", type=int, default=0, help="also list the last N kernels of each "
                        "method's profiled run in order, with the idle gaps between them")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of this script")
    parser.add_argument("--synthetic-acceptance", default="", help="the verdicts follow this profile (a "
                        "mean length L or rates p1,p2,...; engine.core.synthetic), not the random heads' own")
    args = parser.parse_args()
    import warnings

    import torch

    from engine.core.decoder import SpeculativeDecoder
    from engine.models.synthetic import build_synthetic_pair

    warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: profile_e2e needs a CUDA GPU (or --device cpu)", file=sys.stderr)
        return 2
    if args.synthetic == "shipped":  # the shipped pair, as the app loads it
        from engine.models.loading import load_pair

        pair = load_pair(None, None, device=args.device, dtype="bfloat16")
    else:
        pair = build_synthetic_pair(args.synthetic, torch.device(args.device), torch.bfloat16).pair
    decoder = SpeculativeDecoder(pair)
    if args.synthetic != "shipped":  # random-weight heads of the published layouts for eagle, eagle3, medusa
        from engine.methods import synthetic_heads

        heads = synthetic_heads.build_heads(pair.target, args.synthetic, args.methods.split(","))
        decoder.use_built_heads({method: head.head for method, head in heads.items()})
    decoder.warm_up()
    print(f"pair {args.synthetic}")
    if args.prefill:
        report_prefill(pair.target, args.top)
    for method in filter(None, args.methods.split(",")):
        report_loop(decoder, method, args.tokens, args.top, args.synthetic_acceptance, args.timeline)
    if args.batch:
        report_batch(pair.target, args.batch, args.top, args.prompt, timeline=args.timeline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
