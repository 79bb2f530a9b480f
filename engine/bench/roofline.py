"""The batch regime's roofline: a step-time model fitted to measured forward times, and what it predicts.

A decoder forward over T tokens (B sequences x n tokens each) reads every weight once, whatever T, and does 2
x params x T flops. Below the knee it is bound by the weight reads (a flat floor); above it by the matrix
products (a line through the origin). The fitted model is

    t(T) = max(floor_ms, ms_per_token x T),  knee = floor_ms / ms_per_token

(with an intercept on the compute-bound line where that fits the measurements better), or where the measured
steps turn from one roof to the other gradually (near the knee a GPU's products are neither purely
weight-bound nor purely compute-bound), the same two roofs joined smoothly:

    t(T) = (floor_ms^p + line(T)^p)^(1/p),  p in SMOOTHNESS (p = inf is the max above)

The fit picks p by the same least squares in log step time, never by the speedups it then predicts.

Speculation at batch B replaces a plain round (one forward of B tokens) by a forward of B (K+1) tokens plus
the draft's steps, and gains E tokens per sequence per round instead of 1: while B (K+1) stays below the knee
the verification is nearly free; past it, its cost grows K+1 times faster than plain decoding's and the
speedup falls below 1 (the crossover)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from engine.analysis.analytic import expected_tokens_per_position

# how the fit may join the two roofs (the p of t = (floor^p + line^p)^(1/p)), the pure roofline first
SMOOTHNESS = (math.inf, 8.0, 4.0, 2.0, 1.5, 1.0)


@dataclass
class Roofline:
    floor_ms: float  # the memory-bound step time
    ms_per_token: float  # the compute-bound slope (0: never compute-bound in the measured range)
    points: list = field(default_factory=list)  # [(tokens, ms)] it was fitted to
    intercept_ms: float = 0.0  # the compute-bound line's value at 0 tokens (0: the pure roofline)
    p: float = math.inf  # how the roofs join (inf: their max; see the module's docstring)

    @property
    def knee(self) -> float:
        """Tokens per forward where the step turns compute-bound (inf: no compute-bound part was found)."""
        if self.ms_per_token <= 0:
            return math.inf
        return max(0.0, (self.floor_ms - self.intercept_ms) / self.ms_per_token)

    def step_ms(self, tokens: float) -> float:
        line = self.intercept_ms + self.ms_per_token * tokens
        if math.isinf(self.p) or line <= 0.0:
            return max(self.floor_ms, line)
        return (self.floor_ms ** self.p + line ** self.p) ** (1.0 / self.p)

    def rates(self, weight_bytes: int, flops_per_token: float) -> dict:
        """The bandwidth and (marginal) matmul rate the fit implies (bytes/s, flop/s)."""
        return {"bandwidth": weight_bytes / (self.floor_ms / 1e3) if self.floor_ms > 0 else 0.0,
                "matmul_flops": flops_per_token / (self.ms_per_token / 1e3) if self.ms_per_token > 0 else 0.0}

    def as_dict(self) -> dict:
        knee = self.knee
        return {"floor_ms": self.floor_ms, "ms_per_token": self.ms_per_token,
                "intercept_ms": self.intercept_ms, "knee_tokens": knee if math.isfinite(knee) else None,
                "smoothness": self.p if math.isfinite(self.p) else None}


def fit_roofline(points: Sequence[tuple]) -> Roofline:
    """Least squares in log time over every split of the points (sorted by tokens) into a memory-bound head
    and a compute-bound tail. The head's geometric mean is the floor; the tail is either the roofline's line
    through the origin (slope: the tail's mean log(t / T)) or, with two tail points or more, a least-squares
    line a + b T (a machine whose step grows before it is compute-bound: launches, a CPU). The candidate
    whose max() model fits best wins; on a tie the simpler one (fewer compute-bound points, no intercept: a
    tail that adds nothing is no knee). points: [(tokens, ms)], tokens > 0, ms > 0."""
    pts = sorted((float(t), float(ms)) for t, ms in points if t > 0 and ms > 0)
    if not pts:
        raise ValueError("no step times to fit")
    logs = [math.log(ms) for _, ms in pts]
    best = None
    for split in range(len(pts), 0, -1):
        tail = pts[split:]
        floor = math.exp(sum(logs[:split]) / split)
        for model in _tail_models(floor, tail):
            error = sum((m - math.log(model.step_ms(t))) ** 2 for (t, _), m in zip(pts, logs, strict=True))
            if best is None or error < best[0] - 1e-9:
                best = (error, model)
    model = best[1]
    if model.ms_per_token > 0:  # the roofs joined smoothly, where that fits the steps better
        for p in SMOOTHNESS[1:]:
            smooth = _refit_smooth(model, p, pts, logs)
            error = _log_error(smooth, pts, logs)
            if error < best[0] - 1e-9:
                best = (error, smooth)
        model = best[1]
    model.points = pts
    return model


def _log_error(model: Roofline, pts: list, logs: list) -> float:
    return sum((m - math.log(model.step_ms(t))) ** 2 for (t, _), m in zip(pts, logs, strict=True))


def _refit_smooth(start: Roofline, p: float, pts: list, logs: list) -> Roofline:
    """The roofs of `start` joined with smoothness p, their floor, slope and intercept refitted (least
    squares in log time, Nelder-Mead from start's values)."""
    def model(v) -> Roofline:
        return Roofline(math.exp(v[0]), math.exp(v[1]), intercept_ms=v[2], p=p)

    def error(v) -> float:
        return _log_error(model(v), pts, logs)

    v = _nelder_mead(error, [math.log(start.floor_ms), math.log(start.ms_per_token), start.intercept_ms],
                     [0.05, 0.1, 0.05 * start.floor_ms])
    return model(v)


def _nelder_mead(f: Callable, x0: list, steps: list, iterations: int = 400) -> list:
    """A small Nelder-Mead minimiser of f over len(x0) variables (initial simplex: x0 and one step along each
    axis)."""
    simplex = [list(x0)] + [[x + (s if i == j else 0.0) for j, x in enumerate(x0)]
                            for i, s in enumerate(steps)]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centre = [sum(x[j] for x in simplex[:-1]) / (len(simplex) - 1) for j in range(len(x0))]
        worst = simplex[-1]

        def toward(t: float, centre=centre, worst=worst) -> list:
            return [c + t * (w - c) for c, w in zip(centre, worst, strict=True)]

        reflected = toward(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = toward(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = toward(0.5)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink toward the best
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, xs, strict=True)]
                                    for xs in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[min(range(len(simplex)), key=values.__getitem__)]


def _tail_models(floor: float, tail: list) -> list:
    """Roofline candidates with this floor for the compute-bound points `tail` [(tokens, ms)]."""
    if not tail:
        return [Roofline(floor, 0.0)]
    slope = math.exp(sum(math.log(ms / t) for t, ms in tail) / len(tail))
    models = [Roofline(floor, slope)]
    ts = [t for t, _ in tail]
    if len(tail) >= 2 and max(ts) > min(ts):
        mean_t, mean_ms = sum(ts) / len(ts), sum(ms for _, ms in tail) / len(tail)
        b = (sum((t - mean_t) * (ms - mean_ms) for t, ms in tail)
             / sum((t - mean_t) ** 2 for t in ts))
        if b > 0:
            models.append(Roofline(floor, b, intercept_ms=mean_ms - b * mean_t))
    return models


# ------------------------------------------------------------------------------------------------ predictions
def round_ms(target: Roofline, batch: int, k: int, draft: Optional[Roofline] = None) -> float:
    """One round at batch B: the verification forward over B (K+1) tokens (B for plain decoding, k = 0) plus
    the draft's K steps (its first feeds up to 2 tokens per sequence, the others 1)."""
    t = target.step_ms(batch * (k + 1))
    if draft is not None and k > 0:
        t += draft.step_ms(2 * batch) + (k - 1) * draft.step_ms(batch)
    return t


def predicted_speedup(target: Roofline, batch: int, k: int, tokens_per_round: float,
                      draft: Optional[Roofline] = None, plain_tokens_per_round: float = 1.0) -> float:
    """Speculative over plain tokens/s at batch B: (E / E_plain) x t_plain_round / t_spec_round."""
    spec = round_ms(target, batch, k, draft)
    return (tokens_per_round / plain_tokens_per_round) * round_ms(target, batch, 0) / spec if spec else 0.0


def tokens_for_k(alphas: Sequence[float], k: int) -> float:
    """E[tokens per round] at K from per-position acceptance (the last alpha extends past the measured
    depth)."""
    if k <= 0:
        return 1.0
    alphas = list(alphas) or [0.0]
    extended = alphas[:k] + [alphas[-1]] * max(0, k - len(alphas))
    return expected_tokens_per_position(extended)


def best_k(target: Roofline, batch: int, alphas: Sequence[float], ks: Sequence[int],
           draft: Optional[Roofline] = None) -> tuple:
    """(K, predicted speedup) of the best K in ks at batch B; K = 0 (speculation off, speedup 1) when none
    gains."""
    best = (0, 1.0)
    for k in ks:
        s = predicted_speedup(target, batch, k, tokens_for_k(alphas, k), draft)
        if s > best[1] + 1e-12:
            best = (k, s)
    return best


def crossover(batches: Sequence[int], speedups: Sequence[float]) -> Optional[float]:
    """The batch past which the speedup stays below 1: interpolated in log2(B) between the last measured batch
    at or above 1 and the next one; the first batch itself when every speedup is below 1; None when the last
    one is not. (A noisy or prompt-dependent curve may dip below 1 and recover: the dip is no crossover.)"""
    pairs = sorted(zip(batches, speedups, strict=True))
    if not pairs or pairs[-1][1] >= 1.0:
        return None
    i = len(pairs)
    while i > 0 and pairs[i - 1][1] < 1.0:
        i -= 1
    if i == 0:
        return float(pairs[0][0])
    (b0, s0), (b, s) = pairs[i - 1], pairs[i]
    frac = (s0 - 1.0) / (s0 - s) if s0 != s else 0.0
    return 2 ** (math.log2(b0) + frac * (math.log2(b) - math.log2(b0)))


def predicted_crossover(target: Roofline, k: int, tokens_per_round: Callable[[int], float],
                        draft: Optional[Roofline] = None, max_batch: int = 1 << 16) -> Optional[float]:
    """The batch past which the predicted speedup stays below 1 (see crossover), searched on a 1/8-octave
    grid up to max_batch. tokens_per_round(B) gives E at B (the measured E of the nearest measured batch)."""
    grid = [2 ** (i / 8) for i in range(int(8 * math.log2(max_batch)) + 1)]
    return crossover(grid, [predicted_speedup(target, b, k, tokens_per_round(b), draft) for b in grid])


# ------------------------------------------------------------------------------------------------ the machine
def measure_matmul_rate(device, dtype: torch.dtype, size: Optional[int] = None, repeats: int = 5) -> float:
    """Flop/s of one large square matrix product (best of `repeats`): the compute roof."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    n = size or (8192 if cuda else 512)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = math.inf
    for _ in range(repeats + 1):
        _sync(device)
        began = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - began)
    return 2.0 * n ** 3 / best


def measure_bandwidth(device, repeats: int = 5) -> float:
    """Bytes/s a reduction reads from memory: engine.bench.runtimes' measurement on CUDA, a 256 MiB sum on
    CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        from engine.bench.runtimes import measure_read_bandwidth

        return measure_read_bandwidth(device)
    data = torch.ones(64 * 2**20, dtype=torch.float32)
    best = math.inf
    for _ in range(repeats + 1):
        began = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - began)
    return data.numel() * 4 / best


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
