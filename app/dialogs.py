"""Small dialogs: sampling parameters, the analytic-model help page, the K and method sweeps and the lossless
check."""
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
<h2>specplay: what you see</h2>
<p>Rounds, generations and draft positions count from 1 everywhere in the window (the JSONL trace keeps the
engine's 0-based <code>round</code>).</p>
<h3>Round view</h3>
<p>The output as it was decoded. Accepted drafts are highlighted; a chain's rejected drafts are struck out
where they were proposed (paler when never reached, because an earlier one was rejected); the target's
<i>correction</i> (after a rejection) and <i>bonus</i> token (after a fully accepted round) have their own
colours; thin bars separate rounds. Tree methods (Medusa, lookahead, EAGLE with a tree) show only the accepted
path inline; the rejected branches fold into one ⋔N mark: hover it to list them, click it to see the tree.</p>
<h3>Clean text</h3>
<p><b>Ctrl+T</b> (or the <i>Clean text</i> box) shows only what the model produced, as plain text. Copy
(<b>Ctrl+C</b>) always gives the clean text, in either view: never rejected drafts, never ↵ marks.</p>
<h3>Token inspector</h3>
<p>Hover a token for its numbers; click to pin them in the Token dock. For a drafted token:
<b>p(x)</b> is the target's probability of it (after temperature, top-k and top-p), <b>q(x)</b> the
drafter's (1 for deterministic drafters such as n-gram and lookahead), <b>min(1, p/q)</b> the chance it
survives, and <b>u</b> the uniform random number it was tested against: accepted when u &lt; min(1, p/q).
The list at the bottom is the target's most likely tokens at that position, from the softmax at the sampling
temperature <i>before</i> top-k and top-p (so with either on, a kept token's p(x) is at least its entry
there: top-k and top-p renormalise over the tokens they keep). A correction or bonus token's p(x) is that same
softmax, as in its list. In a sampled tree round, a sibling tried after a rejected one is tested against the
residual max(p − q, 0), renormalised, and its p(x) is that residual's. Rounds from a server say <i>not given
by the server</i> for p, q, u and the list.</p>
<p><b>The greedy case (T = 0).</b> No random number is drawn: a draft is accepted exactly when it is the
target's most likely token (its argmax). The inspector then shows p(x) as the target's T=1 probability, for
reference only, and no q or min(1, p/q): a draft with p = 0.01 is rejected because another token is the
argmax, not because of a ratio. Tokens after the first rejection are <i>not tested</i>.</p>
<h3>Draft tree</h3>
<p>One round's draft: the committed context at the left, each drafted token a box linked to its parent,
with p, q and u under it (greedy: p only). The thick line is the accepted path, ending in the correction or
bonus token. |◀ ◀ ▶ ▶| move between rounds; ▶| follows the running generation. The dock floats and grows:
drag it out for a large tree.</p>
<h3>Plots</h3>
<p>α per round and its running mean; tokens per target forward against the chain formula
(1 − α<sup>K+1</sup>)/(1 − α) and the per-position form 1 + Σ Π α<sub>j</sub>; time per output token (TPOT)
against TPOT<sub>plain</sub>·(1 + cK)/E, with a dotted line at a plain run's TPOT when the session has one
for the same prompt; the accepted-length histogram; acceptance by draft position; tokens per second, with the
plain run's as a dotted line too. Outliers above the y range
are clipped and marked with a triangle at the top edge. Hover a plot for the values under the mouse. In a
small window the plots become tabs.</p>
<h3>History and Compare</h3>
<p>Every run of the session is in History. Select several (Ctrl/Shift+click) to overlay their running
curves on the plots and list them in the Compare dock: method, K, sampling, α, tokens per forward, tokens/s
with its standard deviation over equal runs, and the speedup over a plain run (Method → Off) of the same
prompt. <b>Session → Run N times</b> repeats the current settings to measure that spread: timings on a busy
machine vary by tens of percent from run to run.</p>
<h3>Exports and replay</h3>
<p>Session → Export metrics CSV writes one row per round with the settings (method, K, temperature, top-k,
top-p, seed, tree size, models, device, dtype), the round's counts and times and the running metrics.
Export trace JSONL writes a header per generation (prompt, settings, models, device, versions) and every
round; <b>Session → Open trace…</b> (or <code>python main.py gui --open-trace FILE</code>) replays it into
the window. Plots export as PNG at twice the screen resolution or as plain SVG.</p>
<p>The session is kept: after every generation and when the window closes it is written beside the settings
file, and the next window puts it back in the History, where suffix decoding goes on from it. Session →
Clear forgets it, and suffix decoding forgets its prompts and outputs too.</p>

<h2>The methods</h2>
<ul>
<li><b>Off</b>: plain autoregressive decoding, one target forward per token; the reference for every
speedup. It has no K and no α.</li>
<li><b>Draft model</b>: a small model of the same tokenizer drafts K tokens one by one; its q is a real
distribution. c is its step cost over the target's.</li>
<li><b>N-gram prompt lookup</b>: finds the latest occurrence of the text's last few tokens earlier in the
context and proposes what followed. Where that gives fewer than K tokens (no match, or a match at the end),
the shipped target's corpus table fills the rest on a GPU: the most frequent continuation of the last token
(or the last two) in the standard library's training files (there a round costs the same whatever it drafts;
on the CPU each drafted row costs, and the lookup runs alone; <code>--ngram-corpus on|off</code> decides).
Free to draft (c ≈ 0), deterministic (q = 1); a round that drafts nothing counts as one target step with no
drafted tokens (it does not enter α).</li>
<li><b>Medusa</b>: extra heads on the target predict the tokens 1..K ahead from its last hidden state; their
top candidates form a tree verified in one forward with a tree attention mask. The tree is chosen every round:
of the candidate paths most often right when the heads were trained, the ones the heads are surest of at this
position, so a round drafts deep where they are sure and wide where they are not. On a GPU (bf16/fp16) each
round after the first is queued behind the one before it as a single captured graph (keep the accepted path,
pick the next tree, verify), so its drafting shows inside the verification phase. Plain decoding's steps, and
greedy rounds of EAGLE's chain and of the draft model, are queued the same way (their drafting a graph of its
own, so it keeps its own phase).</li>
<li><b>Medusa, fixed tree</b>: the same heads with the original Medusa tree, the same every round: the paths
most often right when the heads were trained. Beside Medusa it shows what choosing the tree per position buys
(tokens per forward) and costs (a few more operations a round, which count where a round is short).</li>
<li><b>EAGLE</b>: a one-layer head drafts from the target's hidden features, autoregressively: a chain of K,
or a dynamic tree of N nodes (EAGLE, dynamic tree of 8 nodes).</li>
<li><b>EAGLE-3</b>: like EAGLE, but the head reads the outputs of several of the target's layers (a low, a
middle and the last one) side by side, and it was trained on its own drafts for several steps ("training-time
test"), so its later drafts stay close to the target's: a chain of K or a tree of N nodes. It needs an
EAGLE-3 head in the target's folder (the published architecture in its eagle3/ folder, as the shipped target
has it, or the project's own eagle3_head.safetensors), or one opened with Models → Open draft heads….</li>
<li><b>Lookahead</b>: n-grams collected from the target's own parallel (Jacobi) guesses, verified as a
tree; no extra model.</li>
</ul>

<h3>Suffix decoding and layer skip</h3>
<p><b>Suffix decoding</b> is model-free (c ≈ 0): it finds the longest ending of the text so far that occurred
before, in this prompt and output or in the session's earlier suffix-decoding prompts and outputs (and a
corpus file, from the command line's --suffix-corpus), and drafts a tree of what most often came next there,
the most frequent continuations first, within the tree's node budget. A long, often-seen match drafts deep; a
short or ambiguous one drafts little. It shines when a task repeats: the second run of a similar prompt is
mostly drafted from the first.</p>
<p><b>Layer skip</b> drafts with the target itself: its first L layers (--draft-layers), then its own final
norm and output head, with no extra weights, and the draft reads the target's own cache for those layers. c
is about L divided by the number of layers; α depends on how well the early layers already predict the next
token, which is low for models not trained for early exit.</p>

<h2>Measuring on your machine</h2>
<h3>Model vs measurement</h3>
<p>The panel beside the plots sets the run's measured tokens per forward against the per-position form and
the chain formula, gives α per node and α<sub>d</sub> by draft position with 95% intervals, tests whether one
α fits every position (χ²), and compares the measured TPOT with the cost model's prediction. It scrolls when
it is longer than its cell.</p>
<h3>Why is it slow?</h3>
<p>For the run that just ended, or the one picked in the History: a bar of where a round's time goes
(drafting, verification, bookkeeping) against a plain round, the measured costs with their spread, the best K
predicted from this very run, and findings that each name the figure they rest on (low acceptance, a lookup
drafter that often found nothing to draft, expensive drafting, host-bound rounds, K off its optimum,
compute-bound verification, changed output). The run is re-scored for other K exactly where greedy decoding
determines it (the draft model's and n-gram's rounds; suffix decoding's from what the session's memory held as
the run began), from the per-position acceptance elsewhere; a best K past the run's own K is an extrapolation
and says so.</p>
<h3>Find the fastest K and method</h3>
<p><b>K → Find the fastest K…</b> (<b>Ctrl+K</b>) measures K = 1, 2, 3, 4, 6, 8 on the prompt with the current
method, each K paired with plain runs of the same prompt, and shows measured against predicted speedup; one
click sets the fastest K. <b>Method → Find the fastest method…</b> (<b>Ctrl+M</b>) measures every method the
models can run, round-robin with plain decoding, and offers the fastest. Both keep their table as CSV
(<b>Save CSV…</b>) and leave the session as they found it: what they decode is not remembered by suffix
decoding.</p>
<h3>Check lossless</h3>
<p><b>Method → Check lossless…</b> (<b>Ctrl+L</b>) proves on the prompt that the method did not change the
output: its greedy output against plain greedy decoding token for token, then a χ² test of the first two
sampled tokens over 1,000 seeds against the target's exact distribution.</p>

<h2>The analytic model</h2>
<p>Each round the drafter guesses <b>K</b> tokens and the target model checks all of them, plus one more
position, in a single forward pass. A guessed token survives with probability min(1, p(x)/q(x)); the first
failure ends the round, and the target then supplies a replacement drawn from what is left of p once q is
taken away. When every guess survives, the extra position gives a free <i>bonus</i> token. Each round
produces at least one token, and the text follows the target's distribution exactly.</p>
<h3>Tokens per target forward</h3>
<p>If every guess survives independently with the same probability <b>α</b> (accepted drafted tokens over
drafted tokens; rounds that drafted nothing do not count), on average</p>
<p align="center"><b>E = (1 − α<sup>K+1</sup>) / (1 − α)</b></p>
<p>tokens come out of each target forward (K + 1 when α = 1): α = 0.8 with K = 4 gives about 3.36.</p>
<h3>Per-position form</h3>
<p>Real drafters are better at the first guess than at the fifth, so α falls with depth. With α<sub>i</sub>
the chance that guess i survives given that all earlier ones did,</p>
<p align="center"><b>E = 1 + Σ<sub>i=1..K</sub> Π<sub>j≤i</sub> α<sub>j</sub></b></p>
<h3>Speedup and time per output token</h3>
<p>Let <b>c</b> be the cost of one draft step relative to one target forward (measured when models load). A
round costs roughly 1 + cK target forwards and yields E tokens, so</p>
<p align="center"><b>speedup ≈ E / (1 + cK)</b>, &nbsp;&nbsp;
<b>TPOT ≈ TPOT<sub>plain</sub> · (1 + cK) / E</b></p>
<p>A larger K only pays while the extra guesses still survive often enough to cover their drafting cost: the
best K grows with α and shrinks with c.</p>
<h3>Batch regime</h3>
<p><b>K → Batch regime…</b> (<b>Ctrl+B</b>) decodes the prompt as a batch of B copies, plainly and with the
method (draft model, n-gram or EAGLE's chain), for B = 1, 2, 4, … 32 on the CPU (… 256 on a GPU), and plots
the measured speedup against B beside a roofline fitted to the measured forward times. Speculation spends the
idle compute of memory-bound decoding: as B grows the verification forward of B·(K+1) tokens turns
compute-bound, the gain shrinks and past the <i>crossover</i> it is a loss. The suggestion follows:
speculation on below the crossover (few requests, at night), off above it (the day's busy hours). Esc stops
after the batch it is measuring; a stopped run shows what it measured and suggests nothing.</p>

<h2>Shortcuts</h2>
<table cellpadding="2">
<tr><td><b>Ctrl+Enter</b></td><td>generate (anywhere in the window)</td></tr>
<tr><td><b>Esc</b></td><td>stop whatever runs: a generation, a K or method sweep, a lossless check,
Run N times, the batch regime (after the batch it is measuring)</td></tr>
<tr><td><b>Ctrl+1 … Ctrl+9</b></td><td>method: Off, Draft model, N-gram, Medusa, EAGLE, EAGLE tree,
EAGLE-3, EAGLE-3 tree, Lookahead</td></tr>
<tr><td><b>Ctrl+] / Ctrl+[</b></td><td>K + 1 / K − 1</td></tr>
<tr><td><b>Ctrl+G</b></td><td>greedy on/off</td></tr>
<tr><td><b>Ctrl+T</b></td><td>round view / clean text</td></tr>
<tr><td><b>Ctrl+C</b></td><td>copy the selection as clean text</td></tr>
<tr><td><b>Ctrl+K</b></td><td>find the fastest K</td></tr>
<tr><td><b>Ctrl+M</b></td><td>find the fastest method</td></tr>
<tr><td><b>Ctrl+B</b></td><td>batch regime: the speedup against the batch size</td></tr>
<tr><td><b>Ctrl+L</b></td><td>check lossless</td></tr>
<tr><td><b>Ctrl+Shift+Enter</b></td><td>run N times</td></tr>
<tr><td><b>Ctrl+O</b></td><td>open a trace</td></tr>
<tr><td><b>Ctrl+S / Ctrl+Shift+S / Ctrl+E</b></td><td>export metrics CSV / trace JSONL / plots</td></tr>
<tr><td><b>F1</b></td><td>this page</td></tr>
</table>
"""


class HelpDialog(QDialog):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setWindowTitle("specplay help")
        self.resize(720, 720)
        browser = QTextBrowser()
        browser.setHtml(HELP_HTML)
        buttons = QDialogButtonBox(QDialogButtonBox.Close)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(browser)
        layout.addWidget(buttons)


SWEEP_COLUMNS = (("k", "K", "{}"), ("alpha", "α", "{:.3f}"),
                 ("tokens_per_forward", "tokens / forward", "{:.2f}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
                 ("speedup", "measured\nspeedup", "{:.2f}×"),
                 ("predicted_speedup", "predicted\n(measured costs)", "{:.2f}×"),
                 ("from_run_tokens_per_forward", "tokens / forward\nfrom this run", "{:.2f}"),
                 ("from_run_speedup", "predicted\nfrom this run", "{:.2f}×"),
                 ("textbook_speedup", "textbook\nE/(1+cK)", "{:.2f}×"))  # two-line headers: the table fits


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

    def __init__(self, parent, rows: list, title: str, complete: bool = True):
        super().__init__(parent)
        self.setWindowTitle("Fastest K" if complete else "K sweep (stopped)")
        self.complete = complete
        rows = sorted(rows, key=lambda row: row["k"])
        self.best = fastest_k(rows)
        best_row = next(row for row in rows if row["k"] == self.best)
        bold = next(r for r, row in enumerate(rows) if row["k"] == self.best) if complete else None
        self.table = table = measured_table(rows, sweep_columns(rows), bold)
        if complete:
            verdict = (f"Fastest measured: <b>K = {self.best}</b>, {best_row['speedup']:.2f}× the tokens/s "
                       "of plain decoding on this machine.")
        else:  # a stopped sweep: what it measured, no recommendation from a partial sweep
            measured = ", ".join(str(row["k"]) for row in rows)
            verdict = (f"Stopped after K = {measured}: the sweep did not measure every K, so it recommends "
                       "none.")
        from engine.bench.suite import sweep_steadiness

        unsteady = sweep_steadiness(rows)
        summary = QLabel(f"{title}<br>{verdict}" + (_from_run_line(rows) if complete else "")
                         + (f"<br><i>Note: {unsteady}</i>" if unsteady else ""))
        summary.setWordWrap(True)
        self.summary = summary
        buttons = QDialogButtonBox(QDialogButtonBox.Close)
        self.save_button = save_table_button(self, buttons, rows, "Save the K sweep")
        self.use_button = None
        if complete:
            self.use_button = buttons.addButton(f"Use K = {self.best}", QDialogButtonBox.AcceptRole)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(summary)
        layout.addWidget(table)
        layout.addWidget(buttons)
        self.resize(*fitting_size(table, summary, len(rows)))


def save_table_button(dialog, buttons, rows: list, title: str):
    """A "Save CSV…" button that writes the measured rows (every measured and predicted figure) where the
    user picks (app.exports.export_table, the window as host); None where the dialog has no window."""
    host = dialog.parentWidget()
    if host is None or not hasattr(host, "ask_save_path"):
        return None
    from app import exports

    button = buttons.addButton("Save CSV…", QDialogButtonBox.ActionRole)
    button.clicked.connect(lambda: exports.export_table(host, title, rows))
    return button


def fitting_size(table: QTableWidget, summary: QLabel, rows: int) -> tuple:
    """A dialog size that shows the summary and every column and row of the table without scroll bars
    (within reason)."""
    width = min(1400, max(560, table.horizontalHeader().length() + 48))
    height = summary.heightForWidth(width - 24) + table.horizontalHeader().sizeHint().height() + 30 * rows
    return width, min(900, height + 90)


def measured_table(rows: list, columns, bold_row=None) -> QTableWidget:
    """A read-only table of measured rows: columns are (key, header, format); a value a row lacks (or None)
    shows as a dash; the row bold_row in bold."""
    table = QTableWidget(len(rows), len(columns))
    table.setHorizontalHeaderLabels([label for _, label, _ in columns])
    table.verticalHeader().setVisible(False)
    table.setEditTriggers(QTableWidget.NoEditTriggers)
    for r, row in enumerate(rows):
        for c, (key, _, fmt) in enumerate(columns):
            value = row.get(key)
            item = QTableWidgetItem("–" if value is None else fmt.format(value))
            if isinstance(value, (int, float)) or value is None:  # figures line up on their last digit
                item.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
            if r == bold_row:
                font = item.font()
                font.setBold(True)
                item.setFont(font)
            table.setItem(r, c, item)
    table.resizeColumnsToContents()
    return table


METHOD_SWEEP_COLUMNS = (("label", "method", "{}"), ("alpha", "α", "{:.3f}"),
                        ("tokens_per_forward", "tokens / forward", "{:.2f}"),
                        ("tokens_per_s", "tokens/s", "{:.0f}"), ("speedup", "measured\nspeedup", "{:.2f}×"),
                        ("textbook_speedup", "textbook\nE/(1+cK)", "{:.2f}×"))


class MethodSweepDialog(QDialog):
    """Method → Find the fastest method: every method of the menu that the pair can run, measured on the
    prompt beside plain decoding (round-robin, one process); the fastest, and a button that makes it the
    method of the next runs. rows: engine.bench.suite.bench_methods' (plain decoding's first); left_out:
    {spec: why
    it could not run}."""

    def __init__(self, parent, rows: list, title: str, left_out: dict, complete: bool = True):
        from engine.methods.registry import spec_label

        super().__init__(parent)
        self.setWindowTitle("Fastest method" if complete else "Method sweep (stopped)")
        self.complete = complete
        rows = [dict(row, label=spec_label(*_spec_parts(row["method"]))) for row in rows]
        for row in rows[:1]:  # plain decoding drafts nothing: no α
            row["alpha"] = None
        drafting = rows[1:]
        best_row = max(drafting, key=lambda row: row["speedup"]) if drafting and complete else None
        self.best = None if best_row is None else best_row["method"]
        self.table = measured_table(rows, METHOD_SWEEP_COLUMNS,
                                    None if best_row is None else rows.index(best_row))
        if not complete:  # what it measured, no recommendation from a partial sweep
            measured = ", ".join(row["label"] for row in drafting) or "no drafting method"
            verdict = (f"Stopped after measuring {measured} beside plain decoding: the sweep did not "
                       "measure every method, so it recommends none.")
        elif best_row is None:
            verdict = "No drafting method can run on this pair."
        elif best_row["speedup"] > 1.0:
            verdict = (f"Fastest measured: <b>{best_row['label']}</b>, {best_row['speedup']:.2f}× the "
                       "tokens/s of plain decoding on this machine.")
        else:
            verdict = ("No method beat plain decoding on this machine; the fastest, "
                       f"<b>{best_row['label']}</b>, reached {best_row['speedup']:.2f}×.")
        skipped = "".join(f"<br><i>Not measured: {spec_label(*_spec_parts(spec))}: {_escape(why)}</i>"
                          for spec, why in left_out.items())
        self.summary = QLabel(f"{title}<br>{verdict}{skipped}")
        self.summary.setWordWrap(True)
        buttons = QDialogButtonBox(QDialogButtonBox.Close)
        self.save_button = save_table_button(self, buttons, rows, "Save the method sweep")
        self.use_button = None
        if best_row is not None:
            self.use_button = buttons.addButton(f"Use {best_row['label']}", QDialogButtonBox.AcceptRole)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(self.summary)
        layout.addWidget(self.table)
        layout.addWidget(buttons)
        self.resize(*fitting_size(self.table, self.summary, len(rows)))


def _spec_parts(spec: str) -> tuple:
    from engine.methods.registry import parse_spec

    parsed = parse_spec(spec)
    return parsed.name, parsed.tree_nodes


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
        from engine.analysis.lossless import greedy_summary, sampling_summary

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
