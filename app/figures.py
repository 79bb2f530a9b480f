"""One source for the figures every view shows: TPOT_plain, the measured speedup and c.

TPOT_plain is the time per output token of plain decoding. Where the session holds finished plain runs of
the same prompt and settings (models, sampling, max new tokens), it is theirs: 1000 / their mean tokens/s,
measured. Otherwise it is the calibration's plain round, a calibration, and every label says so. The status
bar, Model vs measurement, Why is it slow?, Compare and the plots' reference lines all take it from
plain_tpot(), and a run's speedup from speedup(): a measured plain run replaces the calibration everywhere at
once. No Qt here.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional

CALIBRATION = "calibration"


@dataclass(frozen=True)
class PlainTpot:
    """TPOT_plain in ms and where it comes from: measured plain runs (their History numbers) or the
    calibration."""

    ms: float
    runs: tuple = ()  # the History indices of the plain runs measured; () = the calibration's figure

    @property
    def measured(self) -> bool:
        return bool(self.runs)

    @property
    def source(self) -> str:
        """'plain run #2', 'plain runs #2, #5' or 'calibration'."""
        if not self.runs:
            return CALIBRATION
        word = "run" if len(self.runs) == 1 else "runs"
        return f"plain {word} " + ", ".join(f"#{i}" for i in self.runs)

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 / self.ms if self.ms > 0 else 0.0

    def label(self) -> str:
        """'TPOT_plain 4.88 ms (measured: plain run #2)' or 'TPOT_plain 3.81 ms (calibration, no plain run
        of this prompt)'."""
        where = f"measured: {self.source}" if self.measured else "calibration, no plain run of this prompt"
        return f"TPOT_plain {self.ms:.2f} ms ({where})"


def _settings(gen) -> tuple:
    """What a plain run must share with a run to be its reference: prompt, models, sampling, length."""
    c = gen.config
    seed = None if c.sampling.greedy else c.seed
    return gen.prompt, gen.models, c.sampling, seed, c.max_new_tokens


def is_plain(gen) -> bool:
    return gen.config.method == "none"


def finished(generations) -> list:
    return [g for g in generations if g.events and g.finish in ("eos", "length")]


def plain_runs(generations, gen) -> list:
    """The finished plain runs of gen's prompt and settings (gen itself too when it is one)."""
    key = _settings(gen)
    return [g for g in finished(generations) if is_plain(g) and _settings(g) == key]


def plain_tpot(generations, gen, calibration=None) -> Optional[PlainTpot]:
    """TPOT_plain for gen: its plain runs' (measured), else the calibration's (gen's own, else the one given);
    None without either."""
    runs = plain_runs(generations, gen) if gen is not None else []
    if runs:
        speeds = [g.events[-1].metrics.tokens_per_s for g in runs]
        mean = statistics.fmean(speeds)
        if mean > 0:
            return PlainTpot(1000.0 / mean, tuple(g.index for g in runs))
    cal = getattr(gen, "calibration", None) or calibration
    if cal is not None and cal.target_step_ms > 0:
        return PlainTpot(float(cal.target_step_ms))
    return None


def speedup(tokens_per_s: float, reference: Optional[PlainTpot]) -> Optional[float]:
    """The measured speedup: tokens/s over TPOT_plain's tokens/s (TPOT_plain / TPOT)."""
    if reference is None or reference.ms <= 0 or tokens_per_s <= 0:
        return None
    return tokens_per_s / reference.tokens_per_s


def run_speedup(generations, gen, calibration=None) -> Optional[float]:
    """gen's measured speedup over TPOT_plain (None while it has no rounds)."""
    if gen is None or not gen.events:
        return None
    return speedup(gen.events[-1].metrics.tokens_per_s, plain_tpot(generations, gen, calibration))


def c_of(calibration, method: str) -> Optional[float]:
    """The textbook c of a method: one draft step over one plain verification, from the calibration."""
    if calibration is None or method == "none":
        return None
    if hasattr(calibration, "c_for"):
        return calibration.c_for(method)
    return calibration.c if method == "draft" else 0.0


def verdict(factor: Optional[float], reference: Optional[PlainTpot]) -> str:
    """'slower than plain decoding (0.56×)' or 'faster than plain decoding (1.80×)', against TPOT_plain's
    source; '' without a factor."""
    if factor is None:
        return ""
    word = "faster" if factor >= 1.0 else "slower"
    against = "" if reference is None or reference.measured else ", against the calibration"
    return f"{word} than plain decoding ({factor:.2f}×{against})"
