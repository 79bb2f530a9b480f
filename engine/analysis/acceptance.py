"""Acceptance models that fit chains and trees: per-depth conditional acceptance, its CI, and a test of the
constant-alpha law.

alpha_d is the chance that depth d is accepted given that depth d - 1 was (for a tree: that some node at depth
d is on the accepted path). The accepted path's length is all a round yields, so E = 1 + sum_d prod_{j<=d}
alpha_j holds for chains and trees alike. The chapter's (1 - alpha^(K+1)) / (1 - alpha) assumes one alpha at
every depth; it is kept as the textbook model, with alpha pooled over depths (for a chain this is the raw
acceptance rate accepted / drafted up to truncation; for a tree, the per-depth average weighted by rounds).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from engine.analysis import analytic
from engine.core.metrics import MetricsAccumulator

Z95 = 1.959964


@dataclass(frozen=True)
class RoundShape:
    """What acceptance needs from a round: its draft depth and accepted path length."""

    depth: int
    accepted: int


def wilson_interval(successes: int, trials: int, z: float = Z95) -> tuple:
    """The Wilson score interval of a binomial proportion ((0, 1) when there were no trials)."""
    if trials <= 0:
        return 0.0, 1.0
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class DepthAcceptance:
    """Per-depth counts: reached[d] rounds whose path reached depth d, accepted[d] of them accepted it."""

    reached: list
    accepted: list

    @classmethod
    def from_rounds(cls, rounds: Iterable[RoundShape]) -> "DepthAcceptance":
        """Counted by the engine's accumulator, the one place the per-depth rule lives."""
        acc = MetricsAccumulator(0)
        for r in rounds:
            acc.add_round(r.depth, r.accepted, r.accepted + 1, r.depth, 0.0, 0.0, 0.0)
        return cls(list(acc.position_reached), list(acc.position_accepted))

    @classmethod
    def from_metrics(cls, metrics) -> "DepthAcceptance":
        """From a RoundMetrics (the live session's running figures): a round reached depth d when it accepted
        at least d drafts, so the counts come from the accepted-length histogram (exact for drafts of one
        depth; a round whose draft was shallower than d counts as reaching it)."""
        histogram = list(metrics.accepted_length_histogram)
        depths = len(metrics.per_position_acceptance)
        reached = [sum(histogram[d:]) for d in range(depths)]
        return cls(reached, [sum(histogram[d + 1:]) for d in range(depths)])

    @property
    def depths(self) -> int:
        return len(self.reached)

    @property
    def alphas(self) -> list:
        return [a / n if n else 0.0 for a, n in zip(self.accepted, self.reached)]

    def intervals(self) -> list:
        """95 % Wilson intervals of each alpha_d."""
        return [wilson_interval(a, n) for a, n in zip(self.accepted, self.reached)]

    @property
    def pooled_alpha(self) -> float:
        """One alpha for all depths: the maximum-likelihood constant alpha (accepted / tested)."""
        reached = sum(self.reached)
        return sum(self.accepted) / reached if reached else 0.0

    def alphas_for(self, k: int) -> list:
        """alpha_0..alpha_{K-1}: measured where the run reached the depth, else the deepest measured one
        (extrapolated; `extrapolated_from` says from which depth on)."""
        alphas = [a for a, n in zip(self.alphas, self.reached) if n > 0][:k]
        tail = alphas[-1] if alphas else self.pooled_alpha
        return alphas + [tail] * (k - len(alphas))

    def extrapolated_from(self) -> int:
        return sum(1 for n in self.reached if n > 0)

    def expected(self, k: int) -> float:
        """The per-depth E = 1 + sum_{d<K} prod_{j<=d} alpha_j."""
        return analytic.expected_tokens_per_position(self.alphas_for(k))

    def tokens_distribution(self, k: int) -> list:
        """P(a round yields l + 1 tokens) for l = 0..K under the per-depth model."""
        alphas, survive, out = self.alphas_for(k), 1.0, []
        for a in alphas:
            out.append(survive * (1 - a))
            survive *= a
        return out + [survive]

    def expected_rounds(self, tokens: int, k: int, cut: bool = True) -> float:
        """Rounds to emit `tokens` tokens: tokens / E, plus, when the generation's last round was cut (at the
        token budget or an end of text), the renewal overshoot E[X^2] / 2E^2 (X: a round's tokens)."""
        dist = self.tokens_distribution(k)
        mean = sum(p * (i + 1) for i, p in enumerate(dist))
        if tokens <= 0 or mean <= 0:
            return 0.0
        second = sum(p * (i + 1) ** 2 for i, p in enumerate(dist))
        return tokens / mean + (second / (2 * mean * mean) if cut else 0.0)

    def uniform_expected(self, k: int) -> float:
        """The chapter's model at the pooled alpha: (1 - alpha^(K+1)) / (1 - alpha)."""
        return analytic.expected_tokens(min(max(self.pooled_alpha, 0.0), 1.0), k)


@dataclass(frozen=True)
class GeometricTest:
    """Observed accepted lengths against the truncated geometric law of a constant alpha."""

    alpha: float
    observed: list  # rounds by accepted length (bins merged where the expectation was small)
    expected: list
    statistic: float
    dof: int
    p_value: float

    @property
    def holds(self) -> bool:
        """True when the constant-alpha law is not rejected at the 1 % level."""
        return self.p_value >= 0.01


def geometric_test(rounds: Sequence[RoundShape], min_expected: float = 5.0) -> GeometricTest:
    """chi^2 of the accepted-length histogram against P(L = l) = alpha^l (1 - alpha) for l < D, alpha^D at D,
    each round with its own draft depth D, alpha the pooled (maximum-likelihood) one. Tail bins with an
    expectation below min_expected are merged; dof = bins - 2 (alpha is fitted)."""
    rounds = [r for r in rounds if r.depth > 0]
    alpha = DepthAcceptance.from_rounds(rounds).pooled_alpha
    top = max((r.depth for r in rounds), default=0)
    observed, expected = [0.0] * (top + 1), [0.0] * (top + 1)
    for r in rounds:
        observed[min(r.accepted, r.depth)] += 1
        for length in range(r.depth + 1):
            expected[length] += alpha ** length * ((1 - alpha) if length < r.depth else 1.0)
    observed, expected = _merge_small(observed, expected, min_expected)
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    dof = len(observed) - 2
    p_value = analytic.chi2_sf(statistic, dof) if dof > 0 else 1.0
    return GeometricTest(alpha, observed, expected, statistic, max(dof, 0), p_value)


def _merge_small(observed: list, expected: list, minimum: float) -> tuple:
    """Merge bins from both ends inward until each expectation reaches `minimum`."""
    obs, exp = list(observed), list(expected)
    while len(exp) > 1 and exp[-1] < minimum:  # pop first: `a[-2] += a.pop()` would add to the wrong bin
        o, e = obs.pop(), exp.pop()
        obs[-1] += o
        exp[-1] += e
    while len(exp) > 1 and exp[0] < minimum:
        o, e = obs.pop(0), exp.pop(0)
        obs[0] += o
        exp[0] += e
    merged_obs, merged_exp, o_acc, e_acc = [], [], 0.0, 0.0
    for o, e in zip(obs, exp):  # inner bins: carry small ones into the next
        o_acc, e_acc = o_acc + o, e_acc + e
        if e_acc >= minimum:
            merged_obs.append(o_acc)
            merged_exp.append(e_acc)
            o_acc = e_acc = 0.0
    if e_acc > 0 or o_acc > 0:
        if merged_exp:
            merged_obs[-1] += o_acc
            merged_exp[-1] += e_acc
        else:
            merged_obs, merged_exp = [o_acc], [e_acc]
    return merged_obs, merged_exp
