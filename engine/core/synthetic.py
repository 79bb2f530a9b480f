"""Synthetic acceptance: verification runs as usual, but its accept/reject verdict follows a given profile.

For timing studies (llama.cpp's --spec-synth-len / --spec-synth-rates, SGLang's simulated acceptance): what a
round costs and what an acceptance length buys, on random-weight shapes or on any pair, before a drafter that
reaches that acceptance exists. The text such a run produces is NOT model output: every event, CSV row, trace
header and printed summary says so, and the losslessness checks refuse it.

Two spellings (GenerationConfig.synthetic_acceptance):
- "L", a mean acceptance length including the target's token, 1 <= L <= K + 1. It becomes one rate alpha at
  every draft position, the alpha with (1 - alpha^(K+1)) / (1 - alpha) = L (the textbook E(alpha, K)), so the
  mean tokens per round of a round that drafted K is L, and the cost model's E is L.
- "p1,p2,...", per-position rates in [0, 1], at most K: position i is accepted with probability p_i given that
  every earlier position was; positions past the list take its last rate (so "0.8," is 0.8 at every
  position: one number without a comma is a length).

A round that drafted n positions accepts its first a of them, a drawn from the rates (at most n) from a
seeded even-spread sequence (AcceptanceSampler: a short run's mean comes close to the profile's); the token
after them is the target's most likely token at that row, a valid token the target's verification computed.
No torch at import: engine.config validates profiles and the CLI must start light.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from engine.errors import SpecplayError

NOTE = "SYNTHETIC acceptance: the text is not model output (accept/reject follows a given profile)"
SEED_SALT = 0x5EC  # the profile's generator is apart from the sampling's (one seed, two streams of draws)


@dataclass(frozen=True)
class SyntheticAcceptance:
    """A parsed profile: a mean length (length set) or per-position rates (rates set)."""

    length: Optional[float] = None
    rates: tuple = ()

    @classmethod
    def parse(cls, text: str) -> Optional["SyntheticAcceptance"]:
        """The profile of a spelling: one number is a mean length ("3.2"), a comma-separated list is rates
        ("0.9,0.8,0.5"; one rate for every position is "0.8,"); None for ""; SpecplayError when malformed."""
        if not isinstance(text, str):
            raise SpecplayError(f"synthetic acceptance must be text such as 3.2 or 0.9,0.8 (got {text!r})")
        if not text.strip():
            return None
        if "," not in text:
            return cls(length=_number(text.strip(), text))
        values = [_number(p.strip(), text) for p in text.split(",") if p.strip()]
        if not values:
            raise SpecplayError(f"synthetic acceptance rates: none given in {text!r}")
        for value in values:
            if not 0.0 <= value <= 1.0:
                raise SpecplayError(f"synthetic acceptance rates must be in [0, 1] "
                                    f"(got {value:g} in {text!r})")
        return cls(rates=tuple(values))

    def check(self, k: int) -> None:
        """Refuse a profile that K cannot follow: a length outside 1..K+1, more rates than K."""
        if self.length is not None and not 1.0 <= self.length <= k + 1:
            raise SpecplayError(f"synthetic acceptance length {self.length:g} is outside 1..K+1 = 1..{k + 1} "
                                f"(at K = {k})")
        if len(self.rates) > k:
            raise SpecplayError(f"synthetic acceptance gives {len(self.rates)} rates for K = {k}: "
                                f"at most K rates")

    @property
    def text(self) -> str:
        """The canonical spelling (what configs, headers and CSV rows carry; parse reads it back)."""
        if self.length is not None:
            return f"{self.length:g}"
        return ",".join(f"{r:g}" for r in self.rates) + ("," if len(self.rates) == 1 else "")

    def describe(self) -> str:
        if self.length is not None:
            return f"mean acceptance length {self.length:g} (one rate at every position)"
        return f"per-position rates {self.text}"

    def position_rates(self, k: int) -> list:
        """The acceptance rate at each of K draft positions."""
        if self.length is not None:
            return [rate_for_length(self.length, k)] * k
        return [self.rates[min(i, len(self.rates) - 1)] for i in range(k)]

    def expected_tokens(self, k: int, depth: Optional[int] = None) -> float:
        """E: tokens a round emits on average when it drafts `depth` positions (default K)."""
        total, survive = 1.0, 1.0
        for rate in self.position_rates(k)[:k if depth is None else depth]:
            survive *= rate
            total += survive
        return total

    def sampler(self, k: int, seed: int) -> "AcceptanceSampler":
        return AcceptanceSampler(self.position_rates(k), seed)


def _number(part: str, text: str) -> float:
    try:
        value = float(part)
    except ValueError:
        raise SpecplayError(f"synthetic acceptance must be a length such as 3.2 or rates such as 0.9,0.8 "
                            f"(got {text!r})") from None
    if not math.isfinite(value):
        raise SpecplayError(f"synthetic acceptance must be finite (got {part!r})")
    return value


def rate_for_length(length: float, k: int) -> float:
    """The alpha in [0, 1] whose E(alpha, K) = (1 - alpha^(K+1)) / (1 - alpha) is `length` (bisection)."""
    from engine.analysis.analytic import alpha_from_tokens_per_forward

    if length >= k + 1:
        return 1.0
    if length <= 1.0:
        return 0.0
    return alpha_from_tokens_per_forward(length, k)


GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0  # the step of the additive sequence that fills [0, 1) most evenly


class AcceptanceSampler:
    """One generation's seeded draws of accepted counts; the one place the verdict of a synthetic round is
    decided (the single-sequence decoder and the batched one both ask here).

    Each round (each batch row) takes one number u of a golden-ratio sequence (u, u + g, u + 2g, ... mod 1,
    its start drawn from the seed) and accepts the leading positions whose survival, the product of their
    rates, exceeds u: the accepted count has the profile's distribution (P(a >= i) = p1 ... pi, so position
    i is accepted at rate p_i given the earlier ones), and over R rounds its mean strays from the profile's by
    about 1/R rather than 1/sqrt(R) for independent draws: a short timing run shows the E it was given."""

    def __init__(self, rates: Sequence[float], seed: int):
        import random

        self.survival = []  # [K] non-increasing: P(a >= i + 1)
        for rate in list(rates) or [0.0]:
            self.survival.append((self.survival[-1] if self.survival else 1.0) * float(rate))
        self.u = random.Random((int(seed) + SEED_SALT) % (1 << 63)).random()

    def accepted(self, drafted: Sequence[int]) -> list:
        """For rounds (or batch rows) that drafted `drafted[i]` positions each: how many of their first
        positions are accepted."""
        counts = []
        for n in drafted:
            run = sum(1 for s in self.survival if s > self.u)  # the survival is non-increasing
            self.u = (self.u + GOLDEN) % 1.0
            counts.append(min(run, int(n)))
        return counts


def profile_of(config) -> Optional[SyntheticAcceptance]:
    """The synthetic profile of a GenerationConfig, or None (real verification)."""
    return SyntheticAcceptance.parse(getattr(config, "synthetic_acceptance", "") or "")


def synthetic_note(config) -> str:
    """The line every output of a run with a synthetic profile carries ("" for a real one)."""
    profile = SyntheticAcceptance.parse(config.synthetic_acceptance)
    return "" if profile is None else f"{NOTE}: {profile.describe()}"
