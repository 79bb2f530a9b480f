"""Micro-benchmark: one verify + sample round, CUDA kernels against the torch reference on the same GPU.

A round is `verify_chain_stochastic` on target logits [1, K+1, V] with draft distributions [1, K, V] (fp32
logits) followed by `sample` of one row [1, V] (T = 1, no top-k / top-p).  Times are CUDA-event medians of
back-to-back calls (launch and Python overhead included, no CUDA graphs).  The bytes floor is the logits and
draft-probability bytes read once, over the HBM bandwidth (nominal 4.8 TB/s for an H200).  Host syncs per
round are counted with torch's sync debug mode.
"""
from __future__ import annotations

import statistics
import warnings

import torch

from engine.kernels import reference

HBM_BYTES_PER_S = 4.8e12


def _time_us(fn, repeats: int, inner: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / inner)
    return statistics.median(samples)


def _count_syncs(fn) -> int:
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    return sum(1 for w in caught if "synchroniz" in str(w.message).lower())


def run_kernel_bench(ks=(1, 4, 8, 16), vocabs=(8192, 32768, 151936), device="cuda", repeats: int = 7,
                     reference_repeats: int = 3) -> list[dict]:
    """Microseconds per round (verify_chain_stochastic + sample) for each K x V: kernel vs torch reference."""
    from engine.kernels import cuda as kc

    dev = torch.device(device)
    kc.warm_up(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for vocab in vocabs:
        for k in ks:
            logits = torch.randn(1, k + 1, vocab, generator=g, device=dev) * 3
            q = torch.softmax(torch.randn(1, k, vocab, generator=g, device=dev) * 3, -1)
            draft = torch.multinomial(q[0], 1, generator=g).reshape(1, k)
            u = torch.rand(1, k + 1, generator=g, device=dev)
            srow = logits[:, 0].contiguous()
            su = u[:, 0].contiguous()

            def round_with(backend):
                def go():
                    backend.verify_chain_stochastic(logits, draft, q, u, 1.0)  # noqa: B023 timed in this iteration
                    backend.sample(srow, su, 1.0)  # noqa: B023 timed in this iteration
                return go

            def verify_only():
                kc.verify_chain_stochastic(logits, draft, q, u, 1.0)  # noqa: B023 timed in this iteration

            def sample_only():
                kc.sample(srow, su, 1.0)  # noqa: B023 timed in this iteration

            kern = round_with(kc)
            refr = round_with(reference)
            bytes_read = (k + 1) * vocab * 4 + k * vocab * 4 + vocab * 4
            rows.append({
                "K": k, "V": vocab,
                "kernel_us": _time_us(kern, repeats, 20),
                "kernel_verify_us": _time_us(verify_only, repeats, 20),
                "kernel_sample_us": _time_us(sample_only, repeats, 20),
                "reference_us": _time_us(refr, reference_repeats, 1),
                "floor_us": bytes_read / HBM_BYTES_PER_S * 1e6,
                "kernel_syncs": _count_syncs(kern),
                "reference_syncs": _count_syncs(refr),
            })
    return rows


def format_table(rows: list[dict]) -> str:
    head = (f"{'K':>3} {'V':>7} {'kernel us':>10} {'(verify':>8} {'sample)':>8} {'torch ref us':>13} "
            f"{'speedup':>8} {'floor us':>9} {'syncs k/ref':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['K']:>3} {r['V']:>7} {r['kernel_us']:>10.1f} {r['kernel_verify_us']:>8.1f} "
                     f"{r['kernel_sample_us']:>8.1f} {r['reference_us']:>13.1f} "
                     f"{r['reference_us'] / r['kernel_us']:>7.1f}x {r['floor_us']:>9.2f} "
                     f"{r['kernel_syncs']:>5}/{r['reference_syncs']:<6}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_table(run_kernel_bench()))
