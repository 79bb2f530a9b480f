"""The "Why is it slow?" dock: phase bars of the run against a plain round, and the findings of
engine.analysis.diagnose, each naming the figure it rests on. Also the worker that recalibrates the cost
model."""
from __future__ import annotations

import html
from typing import Optional

from PySide6.QtWidgets import QTextBrowser

from app.workers import Worker

PHASE_COLORS = (("draft", "#e69f00"), ("verify", "#0072b2"), ("overhead", "#999999"))
BAR_PX = 260  # the widest bar
DIAGNOSIS_KS = tuple(range(1, 17))


class DiagnosisView(QTextBrowser):
    """Shows the diagnosis of the generation shown: the one that just ended, or a finished one picked in the
    History."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.diagnosis = None
        self.setPlaceholderText("Generate with a drafting method: this view says where each round's time "
                                "goes and why the run is as fast as it is.")

    def clear_generation(self) -> None:
        """Nothing to diagnose (a cleared session): the placeholder again."""
        self.diagnosis = None
        self.clear()

    def show_generation(self, events: list, calibration=None, header: Optional[dict] = None,
                        replay=None, plain=None) -> None:
        """Diagnose a generation's events here, on the calling thread (see DiagnosisWorker for the window)."""
        self.show_diagnosis(*diagnose_generation(events, calibration, header, replay, plain))

    def show_diagnosis(self, diagnosis, problem: Optional[str] = None) -> None:
        """Show a diagnosis (engine.analysis.diagnose), or why there is none."""
        self.diagnosis = diagnosis
        if diagnosis is not None:
            self.setHtml(diagnosis_html(diagnosis))
        elif problem:
            self.setHtml(f"<b>No diagnosis</b>: {html.escape(problem)}")


def diagnose_generation(events: list, calibration=None, header: Optional[dict] = None, replay=None,
                        plain=None) -> tuple:
    """(Diagnosis, None), or (None, why not): a generation's events diagnosed with the calibrated cost model
    (refitted on them). header: the generation's trace header (its settings and prompt ids make the
    prediction exact where it can be); replay: its rounds replayed at any K
    (engine.analysis.predict.Trace.replay); plain: TPOT_plain (app.figures.PlainTpot) as every view shows it.
    No Qt: runs on a worker thread too."""
    from engine.analysis.diagnose import diagnose
    from engine.analysis.predict import trace_from_events

    if not events:
        return None, None
    try:
        trace = trace_from_events(events)
        trace.header = dict(header or {})
        trace.replay = replay
        where = {} if plain is None else {"plain_ms": plain.ms, "plain_source": plain.source}
        return diagnose(trace, getattr(calibration, "costs", None), DIAGNOSIS_KS, **where), None
    except (ValueError, ZeroDivisionError, KeyError, AttributeError) as exc:
        return None, str(exc)


class DiagnosisWorker(Worker):
    """Diagnoses a generation off the GUI thread: replaying a lookup drafter at every K of the prediction is
    pure Python that grows with the run (tens of ms for 160 tokens, more for long runs). Posts
    ("diagnosis", Diagnosis or None, problem)."""

    def __init__(self, events: list, calibration=None, header: Optional[dict] = None, replay=None,
                 plain=None):
        super().__init__()
        self.request = (list(events), calibration, header, replay, plain)

    def work(self) -> None:
        self.post("diagnosis", *diagnose_generation(*self.request))


def diagnosis_html(d) -> str:
    """The verdict, phase bars (ms a round and ms a token) and the findings, as rich text."""
    scale = BAR_PX / max(max(b.total_ms for b in d.bars), 1e-9)
    parts = []
    if d.verdict is not None:
        color = "#1a7f37" if d.verdict.rule == "faster" else "#b42318"
        parts.append(f"<p style='font-size:large'><font color='{color}'><b>{html.escape(d.verdict.title)}"
                     f"</b></font>: {html.escape(d.verdict.advice)}<br><i>figure: "
                     f"{html.escape(d.verdict.figure)}</i></p>")
    parts.append("<b>Where a round's time goes</b> (draft / verify / overhead)")
    for bar in d.bars:  # the label and its figures on a line of their own, the bar below: a narrow dock
        cells = "".join(f"<td bgcolor='{color}' width='{max(1, int(getattr(bar, name + '_ms') * scale))}'>"
                        "&nbsp;</td>" for name, color in PHASE_COLORS)  # ... never cuts the label
        parts.append(f"<p style='margin:4px 0 1px 0'>{html.escape(bar.label)}: {bar.total_ms:.2f} ms, "
                     f"{bar.tokens:.2f} tok, <b>{bar.per_token_ms:.2f} ms/tok</b></p>"
                     f"<table cellspacing='0'><tr>{cells}</tr></table>")
    legend = " ".join(f"<font color='{color}'>■</font> {name}" for name, color in PHASE_COLORS)
    parts.append(legend)
    best = d.report.best
    parts.append(f"<br>Predicted best K from this run: <b>{best.k}</b> ({best.speedup:.2f}×, {best.basis}); "
                 f"costs: {html.escape(d.report.costs.describe(d.report.trace.method, plain=False))}")
    findings = [f for f in d.findings if f.rule != "slower"]  # the verdict says it first
    if not findings:
        parts.append("<br><b>Findings</b>: none, the run looks healthy.")
    else:
        parts.append("<br><b>Findings</b><ul>")
        for f in findings:
            parts.append(f"<li><b>{html.escape(f.title)}</b>: {html.escape(f.advice)}<br>"
                         f"<i>figure: {html.escape(f.figure)}</i></li>")
        parts.append("</ul>")
    return "".join(parts)


class CalibrateWorker(Worker):
    """Recalibrates the cost model (decoder.calibrate) off the GUI thread; posts ("calibrated", cal)."""

    def __init__(self, decoder, k: int):
        super().__init__()
        self.decoder = decoder
        self.k = k

    def work(self) -> None:
        self.post("calibrated", self.decoder.calibrate(self.k))
