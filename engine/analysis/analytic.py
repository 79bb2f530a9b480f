"""The analytic speed model of speculative decoding.

alpha: probability that a drafted token is accepted (independent per position); K: tokens drafted per round;
c: cost of one draft step / cost of one target forward.
"""
from __future__ import annotations

import math
from typing import Sequence


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens per target forward] = (1 - alpha^(K+1)) / (1 - alpha); K + 1 when alpha = 1."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"K must be >= 0, got {k}")
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_tokens_per_position(alphas: Sequence[float]) -> float:
    """E = 1 + sum_i prod_{j<=i} alpha_j, with alpha_i the acceptance rate at draft position i given that
    every earlier position was accepted (what real drafters follow: alpha falls with depth)."""
    total, survive = 1.0, 1.0
    for a in alphas:
        survive *= a
        total += survive
    return total


def speedup(alpha: float, k: int, c: float) -> float:
    """Net speedup over plain decoding: E(alpha, K) / (1 + c K)."""
    return expected_tokens(alpha, k) / (1.0 + c * k)


def optimal_k(alpha: float, c: float, k_max: int = 16) -> tuple[int, float]:
    """The K in 0..k_max with the best predicted speedup (K = 0 is plain decoding, speedup 1)."""
    best_k, best = 0, 1.0
    for k in range(1, k_max + 1):
        s = speedup(alpha, k, c)
        if s > best + 1e-12:
            best_k, best = k, s
    return best_k, best


def predicted_tpot(tpot_plain_ms: float, c: float, k: int, expected: float) -> float:
    """Predicted time per output token: TPOT_plain * (1 + c K) / E."""
    return tpot_plain_ms * (1.0 + c * k) / expected


def alpha_from_tokens_per_forward(tokens_per_forward: float, k: int) -> float:
    """Invert E(alpha, K) by bisection: the alpha that explains a measured tokens-per-forward."""
    target = min(max(tokens_per_forward, 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens(mid, k) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def batch_speedup(alpha: float, k: int, c: float, batch: int, critical_batch: float) -> float:
    """Speedup in the batch regime, a roofline sketch: a target forward over n tokens costs
    max(1, n / critical_batch) memory-bound forwards, where critical_batch is the token count at which the
    forward turns compute-bound. Speculation multiplies the verified tokens by K + 1, so the gain shrinks as
    the batch grows and turns negative once verification is compute-bound."""
    plain_cost = max(1.0, batch / critical_batch)
    spec_cost = max(1.0, batch * (k + 1) / critical_batch) + c * k * max(1.0, batch / critical_batch)
    return expected_tokens(alpha, k) * plain_cost / spec_cost


def chi2_sf(statistic: float, dof: int) -> float:
    """Survival function of the chi-squared distribution (p-value), via the regularised gamma function."""
    import torch

    if dof <= 0:
        return 1.0
    value = torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                    torch.tensor(statistic / 2.0, dtype=torch.float64))
    return float(value) if math.isfinite(float(value)) else 0.0
