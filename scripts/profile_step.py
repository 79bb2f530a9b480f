"""One replayed target step of a synthetic shape: its time beside the weight-read floor, the decode path
against the cuBLAS + SDPA path, and the GPU time of each kernel inside the step.

    python scripts/profile_step.py --synthetic llama-1b [--sizes 1,5] [--top 12]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PREFIX = 200  # cached tokens before the timed block


def replay_ms(runner, tokens, repeats: int = 100, prefix: int = PREFIX, warmups: int = 3) -> float:
    """Milliseconds per step (graph replay, inputs copied in, outputs cloned), CUDA events around the loop;
    the cache is rolled back to `prefix` rows after each step."""
    import torch

    for _ in range(warmups):
        runner.forward(tokens)
        runner.rollback(prefix)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        runner.forward(tokens)
        runner.rollback(prefix)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def kernel_table(runner, tokens, top: int, steps: int = 20) -> str:
    """The step's kernels by GPU time per step (profiled over `steps` replays)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.forward(tokens)
            runner.rollback(PREFIX)
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    rows.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows) / steps
    lines = [f"  GPU time per step {total / 1000:.3f} ms in {sum(e.count for e in rows) // steps} kernels"]
    for e in rows[:top]:
        lines.append(f"  {e.device_time_total / steps:9.1f} us  x{e.count // steps:<4d} {e.key[:90]}")
    return "\n".join(lines)


def main() -> int:
    import os

    import torch

    from engine import llama
    from engine.runtimes import floor_ms, measure_read_bandwidth
    from engine.synthetic import build_synthetic_pair, weight_bytes_per_step

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic", default="llama-1b", help="a synthetic shape, or 'shipped'")
    parser.add_argument("--sizes", default="1,5")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    _ignore_profiler_warnings()
    if not torch.cuda.is_available():
        print("error: profile_step needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    if args.synthetic == "shipped":
        from engine.models import load_pair

        target = load_pair(None, None, device=device, need_draft=False, dtype=torch.bfloat16).target
    else:
        target = build_synthetic_pair(args.synthetic, device, torch.bfloat16).pair.target
    bandwidth = measure_read_bandwidth(device)
    floor = floor_ms(weight_bytes_per_step(target), bandwidth)
    print(f"{args.synthetic}: weights {weight_bytes_per_step(target) / 1e9:.2f} GB, read bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s, floor {floor:.3f} ms per step")
    decode_kernels = target.decode_kernels
    variants = [("decode path, sp_gemv for 1 row", decode_kernels, 1),
                ("decode path, sp_gemv up to 8 rows", decode_kernels, 8), ("cuBLAS + SDPA", None, 1)]
    with torch.inference_mode():
        target.reset()
        target.forward(torch.arange(3, 3 + PREFIX, device=device) % target.vocab_size)
        for n in (int(v) for v in args.sizes.split(",")):
            tokens = torch.arange(5, 5 + n, device=device)
            for label, kernels, gemv_rows in variants:
                if (kernels is None and label != "cuBLAS + SDPA") or (n == 1 and gemv_rows > 1):
                    continue
                llama.DECODE_GEMV_ROWS = gemv_rows
                target.decode_kernels, target._gemv_ok = kernels, {}
                target._graphs.clear()
                target._graph_pool = None  # a fresh pool: re-capturing into a pool of freed graphs fails
                ms = replay_ms(target, tokens)
                print(f"n={n} {label}: {ms:.3f} ms per step ({100 * floor / ms:.1f}% of the floor)")
                print(kernel_table(target, tokens, args.top))
            target.decode_kernels = decode_kernels
    print(f"SPECPLAY_DECODE={os.environ.get('SPECPLAY_DECODE', '1')}")
    return 0


def _ignore_profiler_warnings() -> None:
    import warnings

    warnings.filterwarnings("ignore", message=".*Profiler clears events.*")


if __name__ == "__main__":
    sys.exit(main())
