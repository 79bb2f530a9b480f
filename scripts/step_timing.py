"""Time one target forward (n tokens after a 37-token prefix), eager and replayed from a CUDA graph, and
count the CUDA kernels an eager forward launches.

    python scripts/step_timing.py [--sizes 1,5,9]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def time_forward(runner, tokens, prefix: int, repeats: int = 200) -> float:
    """Microseconds per forward, the cache rolled back after each."""
    import torch

    for _ in range(3):
        runner.forward(tokens)
        runner.rollback(prefix)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        runner.forward(tokens)
        runner.rollback(prefix)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e6


def count_kernels(runner, tokens, prefix: int) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.forward(tokens)
        runner.rollback(prefix)
    return sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")


def main() -> int:
    import torch

    from engine.models import load_pair

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,5,9")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: step_timing needs a CUDA GPU", file=sys.stderr)
        return 2
    runner = load_pair(None, None, device=torch.device("cuda"), need_draft=False).target
    prefix = 37
    with torch.inference_mode():
        runner.reset()
        runner.forward(torch.arange(3, 3 + prefix, device="cuda"))
        for n in (int(v) for v in args.sizes.split(",")):
            tokens = torch.arange(5, 5 + n, device="cuda")
            runner.use_graphs = False
            kernels = count_kernels(runner, tokens, prefix)
            eager = time_forward(runner, tokens, prefix)
            runner.use_graphs = True
            graphed = time_forward(runner, tokens, prefix)
            print(f"n={n}: {kernels} kernels eager; {eager:.0f} us eager, {graphed:.0f} us graph "
                  f"({eager / graphed:.1f}x), {runner.spec.num_layers} layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
