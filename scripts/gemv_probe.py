"""sp_gemv against cuBLAS on the matrices of a decode step: microseconds and read bandwidth per shape, one row
(plain decoding) and a few (a verification block).

    python scripts/gemv_probe.py [--rows 1,5] [--repeats 200]

Each shape cycles through enough copies of its weight to spill the 50 MB L2, so that every launch reads
its weight from memory as a decode step does. (docs/measurements/gemv_probe_first.txt is an earlier version's
run, which also timed a row assignment giving each block a contiguous share: no faster, since removed.)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (name, N, K): a layer's products in the order a step runs them, for the 1B and 7B shapes
SHAPES = [("1b qkv", 2560, 2048), ("1b o", 2048, 2048), ("1b gate_up", 11264, 2048), ("1b down", 2048, 5632),
          ("1b lm_head", 32000, 2048), ("7b qkv", 12288, 4096), ("7b o", 4096, 4096),
          ("7b gate_up", 22016, 4096), ("7b down", 4096, 11008), ("7b lm_head", 32000, 4096)]
SPILL_BYTES = 256 << 20


def time_us(fn, repeats: int) -> float:
    """Microseconds per call of fn(i), `repeats` calls captured in one CUDA graph and replayed (a decode step
    replays its products from a graph too: no host launch cost between them)."""
    import torch

    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(repeats):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats


def probe_shape(kernels, name: str, n: int, k: int, rows: int, repeats: int, bandwidth: float) -> str:
    """One table line: sp_gemv and cuBLAS on an [n, k] weight times `rows` rows."""
    import torch
    import torch.nn.functional as F

    import engine.kernels.step as step

    device = torch.device("cuda")
    nbytes = n * k * 2
    copies = max(2, -(-SPILL_BYTES // nbytes))
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    if not step.gemv_fits(weights[0], rows):
        return f"{name:12s} {rows:4d} {nbytes / 1e6:7.1f}  (more rows than sp_gemv stages)"
    times = {"sp_gemv": time_us(lambda i: kernels.gemv(x, weights[i % copies]), repeats),
             "cublas": time_us(lambda i: F.linear(x, weights[i % copies]), repeats)}
    share = {key: 100 * nbytes / (us * 1e-6) / bandwidth for key, us in times.items()}
    return (f"{name:12s} {rows:4d} {nbytes / 1e6:7.1f} {times['sp_gemv']:11.1f} {times['cublas']:10.1f} "
            f"{share['sp_gemv']:13.1f} {share['cublas']:12.1f}")


def main() -> int:
    import torch

    import engine.kernels.step as step
    from engine.runtimes import measure_read_bandwidth

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,5")
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: gemv_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    kernels = step.StepKernels.load(device)
    bandwidth = measure_read_bandwidth(device)
    print(f"read bandwidth {bandwidth / 1e12:.2f} TB/s; sp_gemv built for {step.GEMV_BLOCKS_PER_SM} blocks "
          "per SM")
    print(f"{'shape':12s} {'rows':>4s} {'MB':>7s} {'sp_gemv us':>11s} {'cuBLAS us':>10s} "
          f"{'% bw sp_gemv':>13s} {'% bw cuBLAS':>12s}")
    for name, n, k in SHAPES:
        for rows in (int(r) for r in args.rows.split(",")):
            print(probe_shape(kernels, name, n, k, rows, args.repeats, bandwidth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
