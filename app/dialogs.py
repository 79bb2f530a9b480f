"""Small dialogs: sampling parameters, the analytic-model help page, the K sweep and the lossless check."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QLabel,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QTextBrowser,
    QVBoxLayout,
)

from engine.config import SamplingParams


class SamplingDialog(QDialog):
    """Greedy, or temperature / top-k / top-p / seed."""

    def __init__(self, parent, greedy: bool, temperature: float, top_k: int, top_p: float, seed: int):
        super().__init__(parent)
        self.setWindowTitle("Sampling")
        self.greedy = QCheckBox("Greedy (temperature 0: accept while draft = target argmax)")
        self.greedy.setChecked(greedy)
        self.temperature = _double(0.05, 5.0, 0.05, temperature)
        self.top_k = QSpinBox()
        self.top_k.setRange(0, 100000)
        self.top_k.setSpecialValueText("off")
        self.top_k.setValue(top_k)
        self.top_p = _double(0.01, 1.0, 0.01, top_p)
        self.seed = QSpinBox()
        self.seed.setRange(0, 2**31 - 1)
        self.seed.setValue(seed)
        form = QFormLayout()
        form.addRow(self.greedy)
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-k (0 = off)", self.top_k)
        form.addRow("Top-p (1 = off)", self.top_p)
        form.addRow("Seed", self.seed)
        buttons = QDialogButtonBox(QDialogButtonBox.Ok | QDialogButtonBox.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(buttons)
        self.greedy.toggled.connect(self._sync_enabled)
        self._sync_enabled()

    def _sync_enabled(self) -> None:
        for widget in (self.temperature, self.top_k, self.top_p, self.seed):
            widget.setEnabled(not self.greedy.isChecked())

    def values(self) -> dict:
        return {"decode/greedy": self.greedy.isChecked(), "decode/temperature": self.temperature.value(),
                "decode/top_k": self.top_k.value(), "decode/top_p": self.top_p.value(),
                "decode/seed": self.seed.value()}

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=0.0 if self.greedy.isChecked() else self.temperature.value(),
                              top_k=self.top_k.value(), top_p=self.top_p.value())


def _double(low: float, high: float, step: float, value: float) -> QDoubleSpinBox:
    box = QDoubleSpinBox()
    box.setRange(low, high)
    box.setSingleStep(step)
    box.setDecimals(2)
    box.setValue(value)
    return box


HELP_HTML = """
<h2>The analytic model</h2>
<p>Each round the drafter guesses <b>K</b> tokens and the target model checks all of them, plus one more
position, in a single forward pass. A guessed token survives with probability min(1, p(x)/q(x)), where p is
the target's probability of the token and q the drafter's; the first failure ends the round, and the target
then supplies a replacement token drawn from what is left of p once q is taken away. When every guess
survives, the target's extra position gives a free <i>bonus</i> token. Either way, each round produces at
least one token, and the text follows the target's distribution exactly.</p>
<h3>Tokens per target forward</h3>
<p>If every guess survives independently with the same probability <b>α</b>, the round yields the accepted
prefix plus one target token, and on average</p>
<p align="center"><b>E = (1 − α<sup>K+1</sup>) / (1 − α)</b></p>
<p>tokens come out of each target forward (K + 1 when α = 1). For example α = 0.8 with K = 4 gives about
3.36.</p>
<h3>Per-position form</h3>
<p>Real drafters are better at the first guess than at the fifth, so α falls with depth. With α<sub>i</sub>
the chance that guess i survives given that all earlier ones did,</p>
<p align="center"><b>E = 1 + Σ<sub>i=1..K</sub> Π<sub>j≤i</sub> α<sub>j</sub></b></p>
<p>each term being the chance that the round gets at least i guesses through. The tokens-per-forward plot
shows both forms against the measurement.</p>
<h3>Speedup and time per output token</h3>
<p>Let <b>c</b> be the cost of one draft step relative to one target forward (measured when models load). A
round costs roughly 1 + cK target forwards and yields E tokens, so</p>
<p align="center"><b>speedup ≈ E / (1 + cK)</b>, &nbsp;&nbsp;
<b>TPOT ≈ TPOT<sub>plain</sub> · (1 + cK) / E</b></p>
<p>A larger K only pays while the extra guesses still survive often enough to cover their drafting cost: the
best K grows with α and shrinks with c. Model-free drafters (n-gram prompt lookup) have c ≈ 0.</p>
<h3>Reading the view</h3>
<p>Accepted guesses are highlighted; rejected ones are struck out where they were proposed (paler when they
were never reached); the correction and bonus tokens have their own colours; thin bars separate rounds.
Hover or click a token for p(x), q(x), min(1, p/q), the uniform u it was tested against, and the target's
top alternatives.</p>
"""


class HelpDialog(QDialog):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setWindowTitle("The analytic model")
        self.resize(640, 620)
        browser = QTextBrowser()
        browser.setHtml(HELP_HTML)
        buttons = QDialogButtonBox(QDialogButtonBox.Close)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(browser)
        layout.addWidget(buttons)


SWEEP_COLUMNS = (("k", "K", "{}"), ("alpha", "α", "{:.3f}"),
                 ("tokens_per_forward", "tokens / forward", "{:.2f}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
                 ("speedup", "measured speedup", "{:.2f}×"),
                 ("predicted_speedup", "predicted (measured costs)", "{:.2f}×"),
                 ("from_run_tokens_per_forward", "tokens / forward predicted from this run", "{:.2f}"),
                 ("from_run_speedup", "predicted from this run", "{:.2f}×"),
                 ("textbook_speedup", "textbook E/(1+cK)", "{:.2f}×"))


def fastest_k(rows: list) -> int:
    """The K with the best measured speedup."""
    return max(rows, key=lambda row: row["speedup"])["k"]


def sweep_columns(rows: list) -> list:
    """The columns every row has (a sweep stopped early has no prediction from its largest K's run)."""
    return [col for col in SWEEP_COLUMNS if all(col[0] in row for row in rows)]


class SweepDialog(QDialog):
    """The measured K sweep beside its predictions: the cost model at each K's measured acceptance, the
    counterfactual from the largest K's run alone ("predicted from this run"), and the textbook formula; the
    fastest K, and a button that makes it the K of the next runs."""

    def __init__(self, parent, rows: list, title: str):
        super().__init__(parent)
        self.setWindowTitle("Fastest K")
        rows = sorted(rows, key=lambda row: row["k"])
        self.best = fastest_k(rows)
        best_row = next(row for row in rows if row["k"] == self.best)
        columns = sweep_columns(rows)
        table = QTableWidget(len(rows), len(columns))
        table.setHorizontalHeaderLabels([label for _, label, _ in columns])
        table.verticalHeader().setVisible(False)
        for r, row in enumerate(rows):
            for c, (key, _, fmt) in enumerate(columns):
                item = QTableWidgetItem(fmt.format(row[key]))
                if row["k"] == self.best:
                    font = item.font()
                    font.setBold(True)
                    item.setFont(font)
                table.setItem(r, c, item)
        table.resizeColumnsToContents()
        self.table = table
        summary = QLabel(f"{title}<br>Fastest measured: <b>K = {self.best}</b>, "
                         f"{best_row['speedup']:.2f}× the tokens/s of plain decoding on this machine."
                         + _from_run_line(rows))
        summary.setWordWrap(True)
        buttons = QDialogButtonBox(QDialogButtonBox.Close)
        self.use_button = buttons.addButton(f"Use K = {self.best}", QDialogButtonBox.AcceptRole)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(summary)
        layout.addWidget(table)
        layout.addWidget(buttons)
        self.resize(900, 140 + 30 * len(rows))


def _from_run_line(rows: list) -> str:
    if not all("from_run_speedup" in row for row in rows):
        return ""
    best = max(rows, key=lambda row: row["from_run_speedup"])
    return (f"<br>Predicted from the K = {best['from_run_k']} run alone: best <b>K = {best['k']}</b> "
            f"({best['from_run_speedup']:.2f}×; {best['from_run_basis']}).")


class LosslessDialog(QDialog):
    """The result of Method → Check lossless: the greedy comparison and the chi-squared test, each PASS or
    FAIL."""

    def __init__(self, parent, title: str, greedy, sampling, sampled_params: SamplingParams, describe_token):
        from engine.lossless import greedy_summary, sampling_summary

        super().__init__(parent)
        self.setWindowTitle("Lossless check")
        self.passed = greedy.passed and sampling is not None and sampling.passed
        lines = [greedy_summary(greedy, describe_token),
                 sampling_summary(sampling, sampled_params) if sampling is not None
                 else "sampling: stopped before the end (no verdict)"]
        if not greedy.passed and greedy.top2_logit_gap is not None and greedy.top2_logit_gap < 1e-2:
            lines.append("The target's two best tokens were tied there: in low precision a tie can flip "
                         "between a one-token and a multi-token forward, so this is not proof of a bug.")
        verdict = "<b>Lossless</b>" if self.passed else "<b>Not shown lossless</b>"
        self.text = "\n".join(lines)
        label = QLabel(f"{title}<br>{verdict}<br><br>" + "<br>".join(_escape(line) for line in lines))
        label.setWordWrap(True)
        label.setTextInteractionFlags(label.textInteractionFlags() | Qt.TextSelectableByMouse)
        buttons = QDialogButtonBox(QDialogButtonBox.Close)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(label)
        layout.addWidget(buttons)
        self.resize(620, 200)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
