"""Models → Open draft heads… and Models → Head doctor… (issue 51): published EAGLE, EAGLE-3 and Medusa heads
loaded onto the loaded target, and the head doctor's report, both off the GUI thread.

HeadsWorker calls SpeculativeDecoder.use_heads (the layout detected by engine.methods.public_heads, the
heads checked against the target before anything is allocated) and posts the description; a misfit is the
engine's one line (SpecplayError), shown as a dialog. DoctorWorker runs engine.analysis.doctor.diagnose_heads
and posts its DoctorReport, which DoctorDialog shows as a table (per convention: tokens per forward and α by
draft position with 95 % intervals) above the findings.
"""
from __future__ import annotations

import html
from typing import Optional

from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.widgets import ask_path, finish_form
from app.workers import Worker

HEAD_METHODS = ("eagle", "eagle3", "medusa")  # the methods the doctor diagnoses
DOCTOR_PROMPTS = 2  # held-out prompts the window's doctor runs (the CLI's default is 4)
DOCTOR_NEW_TOKENS = 32  # tokens per prompt (the CLI's default is 48): a short run, off the GUI thread


class HeadsWorker(Worker):
    """Loads published heads onto the loaded decoder's target; posts ("heads", description, availability)."""

    def __init__(self, decoder, path: str):
        super().__init__()
        self.decoder, self.path = decoder, path

    def work(self) -> None:
        description = self.decoder.use_heads(self.path)
        self.post("heads", description, dict(self.decoder.method_availability()))


class DoctorWorker(Worker):
    """The head doctor on the given prompts (None: DOCTOR_PROMPTS held-out ones); posts ("report",
    DoctorReport). It cannot stop early: DOCTOR_NEW_TOKENS tokens a prompt for each convention it tries."""

    def __init__(self, decoder, method: str, k: int, prompts: Optional[list] = None,
                 max_new_tokens: Optional[int] = None):
        super().__init__()
        self.decoder, self.method, self.k = decoder, method, k
        self.prompts = prompts
        self.max_new_tokens = max_new_tokens or DOCTOR_NEW_TOKENS

    @property
    def prompts_text(self) -> str:
        return "the prompt" if self.prompts else f"{DOCTOR_PROMPTS} held-out prompts"

    def work(self) -> None:
        from engine.analysis import doctor

        prompts = self.prompts or doctor.default_prompts(DOCTOR_PROMPTS)
        report = doctor.diagnose_heads(self.decoder, self.method, prompts, self.k, self.max_new_tokens)
        self.post("report", report)


def doctor_method(spec_name: str, heads_info) -> Optional[str]:
    """The head method to diagnose: the Method menu's when it drafts with heads (medusa-fixed: its Medusa
    heads), else the opened heads' method, else None."""
    name = "medusa" if spec_name == "medusa-fixed" else spec_name
    if name in HEAD_METHODS:
        return name
    return getattr(heads_info, "method", None)


class HeadsSourceDialog(QDialog):
    """A heads folder (Browse…) or a Hub id already in the HF cache (nothing is downloaded)."""

    def __init__(self, parent=None, text: str = ""):
        super().__init__(parent)
        self.setWindowTitle("Open draft heads")
        form = QFormLayout(self)
        self.source = QLineEdit(text)
        self.source.setPlaceholderText("a folder, or an id in the HF cache such as yuhuili/EAGLE3-LLaMA3.1-…")
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        row = QWidget()
        line = QHBoxLayout(row)
        line.setContentsMargins(0, 0, 0, 0)
        line.addWidget(self.source, 1)
        line.addWidget(browse)
        form.addRow("Heads folder or cached Hub id", row)
        finish_form(self, form,
                    "EAGLE-1/2 (SafeAILab), EAGLE-3 (SpecForge, vLLM / AngelSlim, speculators) and Medusa "
                    "(FasterDecoding, vLLM) heads, loaded onto the loaded target; heads that do not fit it "
                    "are refused before anything is allocated. Nothing is downloaded.")

    def _browse(self) -> None:
        path = ask_path(self, "Open draft heads folder", QFileDialog.Directory)
        if path:
            self.source.setText(path)

    def choice(self) -> str:
        return self.source.text().strip()


def doctor_rows(report) -> tuple:
    """(headers, rows) of the doctor's table: a row per convention, α by position as 'a [lo, hi]'."""
    depth = max((len(r.acceptance.alphas) for r in report.results), default=0)
    headers = ["convention", "tokens / forward"] + [f"α{i + 1} [95% interval]" for i in range(depth)]
    rows = []
    for result in report.results:
        cells = [result.label, f"{result.tokens_per_forward:.2f}"]
        pairs = zip(result.acceptance.alphas, result.acceptance.intervals(), result.acceptance.reached)
        cells += [f"{a:.2f} [{lo:.2f}, {hi:.2f}]" if n else "not reached" for a, (lo, hi), n in pairs]
        rows.append(cells + [""] * (len(headers) - len(cells)))
    return headers, rows


class DoctorDialog(QDialog):
    """The head doctor's report: the heads, a table of the conventions it measured, coverage and findings."""

    def __init__(self, parent, report):
        super().__init__(parent)
        self.setWindowTitle("Head doctor")
        self.report = report
        layout = QVBoxLayout(self)
        head = QLabel(f"<b>{html.escape(report.method)}</b>, K = {report.k}, greedy<br>"
                      + html.escape(report.description).replace("\n", "<br>"))
        head.setWordWrap(True)
        layout.addWidget(head)
        headers, rows = doctor_rows(report)
        self.table = QTableWidget(len(rows), len(headers))
        self.table.setHorizontalHeaderLabels(headers)
        for r, cells in enumerate(rows):
            for c, text in enumerate(cells):
                self.table.setItem(r, c, QTableWidgetItem(text))
        self.table.resizeColumnsToContents()
        layout.addWidget(self.table, 1)
        self.findings = QLabel(findings_html(report))
        self.findings.setWordWrap(True)
        layout.addWidget(self.findings)
        buttons = QDialogButtonBox(QDialogButtonBox.Close)
        buttons.rejected.connect(self.reject)
        buttons.accepted.connect(self.accept)
        layout.addWidget(buttons)
        self.resize(900, 360)


def findings_html(report) -> str:
    lines = []
    if report.coverage is not None:
        lines.append(f"the draft vocabulary covers {100 * report.coverage:.1f}% of the prompts' and outputs' "
                     "tokens")
    lines += [f"finding: {f}" for f in report.findings]
    return "<br>".join(html.escape(line) for line in lines) or "no findings"
