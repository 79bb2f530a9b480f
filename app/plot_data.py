"""Plot buffers filled from RoundEvents; the plot panel redraws from them on a timer, never per event."""
from __future__ import annotations

import math
from typing import Optional

from app import figures
from engine.analysis import analytic
from engine.analysis.acceptance import DepthAcceptance, RoundShape, geometric_test
from engine.analysis.costmodel import timing_of
from engine.core.metrics import histogram_bars, round_acceptance, round_tokens, round_tpot_ms

# the TPOT plot's two predictions, named alike on the screen and in the exported SVG
PREDICTED_TPOT_LABEL = "t_round/E"  # the cost model's: measured round time over tokens per round
TEXTBOOK_TPOT_LABEL = "TPOT_plain·(1+cK)/E"  # the chapter's
REFIT_ROUNDS = 64  # the live cost model is refitted on this many latest rounds


class PlotBuffers:
    """Everything the live plots show for one generation. Per-round values come from engine.core.metrics'
    functions
    and running ones from each event's RoundMetrics: nothing is recounted here."""

    def __init__(self, calibration=None):
        self.calibration = calibration
        self.plain = figures.plain_tpot([], None, calibration)  # TPOT_plain (app.figures), until told better
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
        self.predicted_tpot: list = []  # the cost model: t_round(K) / E (per-depth E), refitted live
        self.textbook_factors: list = []  # the chapter's (1 + cK) / E_uniform a round, c calibrated
        self.timings: list = []  # RoundTiming of every round (for the live refit)
        self.costs = None  # the cost model refitted on the latest rounds (None without a calibration)
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
        self.timings.append(timing_of(event))
        self.textbook_factors.append(self._textbook_factor(event))
        self.predicted_tpot.append(self._cost_model_tpot(event))
        self.last_event = event
        self.version += 1

    @property
    def length_counts(self) -> list:
        """Rounds by accepted count, a bar for every length up to the deepest draft."""
        return histogram_bars(self.last_event.metrics) if self.last_event is not None else []

    @property
    def per_position_acceptance(self) -> list:
        return list(self.last_event.metrics.per_position_acceptance) if self.last_event is not None else []

    def set_plain(self, plain) -> None:
        """TPOT_plain (app.figures.PlainTpot or None): a measured plain run's replaces the calibration's, and
        the textbook line follows it."""
        if plain != self.plain:
            self.plain = plain
            self.version += 1

    @property
    def textbook_tpot(self) -> list:
        """The chapter's TPOT_plain (1 + cK) / E per round, at the one TPOT_plain of app.figures."""
        plain = self.plain.ms if self.plain is not None else math.nan
        return [plain * factor for factor in self.textbook_factors]

    def _textbook_factor(self, event) -> float:
        """(1 + cK) / E at the running alpha, c calibrated for the method (the chapter's view)."""
        c = figures.c_of(self.calibration, event.method)
        if c is None and event.method != "none":
            return math.nan
        k = len(event.drafted) and event.k
        expected = event.metrics.analytic_tokens_per_forward if k else 1.0
        return analytic.predicted_tpot(1.0, c or 0.0, k, max(expected, 1e-9))

    def _cost_model_tpot(self, event) -> float:
        """t_round(K) / E with E the per-depth model and the cost model refitted on the latest rounds; the
        textbook figure when there is no cost model (an old calibration)."""
        base = getattr(self.calibration, "costs", None)
        if base is None:
            return self.textbook_tpot[-1]  # the textbook figure at the TPOT_plain of the moment
        self.costs = base.refit(self.timings[-REFIT_ROUNDS:])
        timing = self.timings[-1]
        expected = event.metrics.per_position_tokens_per_forward if timing.depth else 1.0
        return self.costs.tpot(event.method, timing.depth, max(expected, 1e-9), timing.block)

    def latest(self, name: str) -> Optional[float]:
        values = getattr(self, name)
        return values[-1] if values else None


def summary_html(buffers: PlotBuffers) -> str:
    """The models' numbers next to the measured ones, for the panel beside the plots: the measured cost model
    and per-depth acceptance first, the chapter's uniform-alpha model beside them, labelled as such."""
    if not buffers.rounds or buffers.last_event is None:
        return "<b>Model vs measurement</b><br>Generate to see the numbers."
    event, m = buffers.last_event, buffers.last_event.metrics
    what = "plain decoding" if event.method == "none" else f"{event.method}, K={event.k}"  # plain: no K
    lines = [f"<b>Model vs measurement</b> &nbsp; {what}, {m.rounds} rounds",
             f"tokens / target forward: measured <b>{m.tokens_per_forward:.2f}</b>, "
             f"per-depth 1+ΣΠα<sub>j</sub> = {m.per_position_tokens_per_forward:.2f}, "
             f"chapter's uniform-α (1−α<sup>K+1</sup>)/(1−α) = {m.analytic_tokens_per_forward:.2f}"]
    if m.drafted:
        lines += _acceptance_lines(m)
    lines.append(f"TPOT measured <b>{m.tpot_ms:.2f} ms</b> ({m.tokens_per_s:.0f} tok/s)")
    lines += _measured_speedup_lines(buffers, event, m)
    lines += _prediction_lines(buffers, event, m)
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


def _acceptance_lines(m) -> list:
    depth = DepthAcceptance.from_metrics(m)
    cells = [f"{a:.2f} [{lo:.2f}, {hi:.2f}]" for a, (lo, hi) in zip(depth.alphas, depth.intervals())]
    lines = [f"α per node (raw rate) = <b>{m.acceptance_rate:.3f}</b>; α<sub>d</sub> by depth (95% CI): "
             + (", ".join(cells) or "-")]
    depths = len(m.per_position_acceptance)
    shapes = [RoundShape(depths, length) for length, n in enumerate(m.accepted_length_histogram)
              for _ in range(n)]
    if depths and len(shapes) >= 10:
        test = geometric_test(shapes)
        verdict = "holds" if test.holds else "<b>rejected</b>"
        lines.append(f"constant-α law (χ² = {test.statistic:.1f}, dof {test.dof}, p = {test.p_value:.3g}): "
                     f"{verdict}")
    return lines


def _measured_speedup_lines(buffers: PlotBuffers, event, m) -> list:
    """The run's one measured speedup over the one TPOT_plain (app.figures), as Compare shows it."""
    plain = buffers.plain
    if plain is None:
        return ["TPOT_plain —: no plain run of this prompt and no calibration"]
    if event.method == "none":
        return [plain.label()]
    factor = figures.speedup(m.tokens_per_s, plain)
    return [f"speedup measured <b>{factor:.2f}×</b>: {figures.verdict(factor, plain)}; {plain.label()}"]


def _prediction_lines(buffers: PlotBuffers, event, m) -> list:
    cal, plain = buffers.calibration, buffers.plain
    if cal is None or plain is None or event.method == "none":
        return []
    lines = []
    costs = buffers.costs
    if costs is not None:
        predicted = buffers.latest("predicted_tpot")
        speedup = plain.ms / predicted if predicted and predicted > 0 else 0.0
        lines.append(f"prediction (measured costs, t_round/E): TPOT <b>{predicted:.2f} ms</b>, "
                     f"speedup {speedup:.2f}× over TPOT_plain")
        lines.append("costs: " + costs.describe(event.method, plain=False))
    c = figures.c_of(cal, event.method)
    textbook = buffers.latest("textbook_tpot")
    lines.append(f"prediction (textbook) TPOT_plain·(1+cK)/E = {textbook:.2f} ms (c = {c:.3f})")
    if m.drafted:
        best_k, best = analytic.optimal_k(min(m.acceptance_rate, 0.999), c)
        textbook_speedup = analytic.speedup(min(m.acceptance_rate, 1.0), event.k, c)
        lines.append(f"prediction (textbook) speedup E/(1+cK) = {textbook_speedup:.2f}×; "
                     f"its best K: {best_k} ({best:.2f}×)")
    return lines
