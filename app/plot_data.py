"""Plot buffers filled from RoundEvents; the plot panel redraws from them on a timer, never per event."""
from __future__ import annotations

import math
from typing import Optional

from engine import analytic
from engine.metrics import histogram_bars, round_acceptance, round_tokens, round_tpot_ms


class PlotBuffers:
    """Everything the live plots show for one generation. Per-round values come from engine.metrics' functions
    and running ones from each event's RoundMetrics: nothing is recounted here."""

    def __init__(self, calibration=None):
        self.calibration = calibration
        self.clear()

    def clear(self) -> None:
        self.rounds: list = []
        self.round_alpha: list = []
        self.running_alpha: list = []
        self.round_tpf: list = []
        self.running_tpf: list = []
        self.analytic_tpf: list = []
        self.per_position_tpf: list = []
        self.round_tpot: list = []
        self.running_tpot: list = []
        self.predicted_tpot: list = []
        self.last_event = None
        self.version = 0  # bumped by every change; the plots redraw what is stale

    def add(self, event) -> None:
        m = event.metrics
        self.rounds.append(event.round)
        self.round_alpha.append(round_acceptance(event))
        self.running_alpha.append(m.acceptance_rate if m.drafted else math.nan)
        self.round_tpf.append(round_tokens(event))
        self.running_tpf.append(m.tokens_per_forward)
        self.analytic_tpf.append(m.analytic_tokens_per_forward)
        self.per_position_tpf.append(m.per_position_tokens_per_forward)
        self.round_tpot.append(round_tpot_ms(event))
        self.running_tpot.append(m.tpot_ms)
        self.predicted_tpot.append(self._predict_tpot(event))
        self.last_event = event
        self.version += 1

    @property
    def length_counts(self) -> list:
        """Rounds by accepted count, a bar for every length up to the deepest draft."""
        return histogram_bars(self.last_event.metrics) if self.last_event is not None else []

    @property
    def per_position_acceptance(self) -> list:
        return list(self.last_event.metrics.per_position_acceptance) if self.last_event is not None else []

    def _predict_tpot(self, event) -> float:
        """TPOT_plain x (1 + cK) / E at the running alpha, with TPOT_plain and c from the calibration.

        c is the draft model's cost ratio; model-free drafters (n-gram, lookahead) cost ~0 a drafted token."""
        cal = self.calibration
        if cal is None or cal.target_step_ms <= 0:
            return math.nan
        k = len(event.drafted) and event.k
        c = cal.c if event.method == "draft" else 0.0
        expected = event.metrics.analytic_tokens_per_forward if k else 1.0
        return analytic.predicted_tpot(cal.target_step_ms, c, k, max(expected, 1e-9))

    def latest(self, name: str) -> Optional[float]:
        values = getattr(self, name)
        return values[-1] if values else None


def summary_html(buffers: PlotBuffers) -> str:
    """The analytic model's numbers next to the measured ones, for the panel beside the plots."""
    if not buffers.rounds or buffers.last_event is None:
        return "<b>Model vs measurement</b><br>Generate to see the numbers."
    event, cal = buffers.last_event, buffers.calibration
    m = event.metrics
    lines = [f"<b>Model vs measurement</b> &nbsp; {event.method}, K={event.k}, {m.rounds} rounds",
             f"tokens / target forward: measured <b>{m.tokens_per_forward:.2f}</b>, "
             f"(1−α<sup>K+1</sup>)/(1−α) = {m.analytic_tokens_per_forward:.2f}, "
             f"per-position = {m.per_position_tokens_per_forward:.2f}"]
    if m.drafted:
        alphas = ", ".join(f"{a:.2f}" for a in buffers.per_position_acceptance)
        lines.append(f"running α = <b>{m.acceptance_rate:.3f}</b>; α<sub>i</sub> by position: {alphas}")
    lines.append(f"TPOT measured <b>{m.tpot_ms:.2f} ms</b> ({m.tokens_per_s:.0f} tok/s)")
    if cal is not None and cal.target_step_ms > 0:
        predicted = buffers.latest("predicted_tpot")
        lines.append(f"TPOT predicted {predicted:.2f} ms from TPOT_plain = {cal.target_step_ms:.2f} ms, "
                     f"c = {cal.c:.3f}")
        if m.drafted and event.method == "draft":
            best_k, best = analytic.optimal_k(min(m.acceptance_rate, 0.999), cal.c)
            lines.append(f"predicted speedup E/(1+cK) = "
                         f"{analytic.speedup(min(m.acceptance_rate, 1.0), event.k, cal.c):.2f}×; "
                         f"best K at this α and c: {best_k} ({best:.2f}×)")
    return "<br>".join(lines)


OUTLIER_FACTOR = 2.0  # values above this many times the 95th percentile are clipped (and marked) in plots


def robust_top(values, quantile: float = 0.95) -> float:
    """The top of a y range that shows the data but not its outliers: just above the largest value, unless
    that is more than OUTLIER_FACTOR times the 95th percentile; then 1.5 times the percentile."""
    finite = sorted(v for v in values if v is not None and math.isfinite(v))
    if not finite:
        return 1.0
    high = finite[-1]
    typical = finite[min(len(finite) - 1, int(quantile * len(finite)))]
    if typical > 0 and high > OUTLIER_FACTOR * typical:
        return 1.5 * typical
    return high * 1.08 if high > 0 else 1.0
