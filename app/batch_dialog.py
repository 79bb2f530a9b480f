"""K → Batch regime: speculation's measured gain against the batch size, beside the roofline's prediction.

The dialog shows what app.workers.BatchWorker measured (engine.bench.batch's BatchReport): the measured
speedup per batch on a log2 axis, the fitted roofline's predicted curve, a line at 1× and the crossover
(where the speedup falls below 1) when the measurements reach it, a table of the rows and one suggested
operating point (speculation on below the crossover, off above it). A stopped or one-batch run shows what it
measured and suggests nothing."""
from __future__ import annotations

import math
from typing import Optional

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QTableWidget, QTableWidgetItem, QVBoxLayout

from app.style import LIGHT, TokenColors
from engine.methods import registry as methods

CPU_BATCHES = (1, 2, 4, 8, 16, 32)  # what K → Batch regime measures on the CPU: small and quick
GPU_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCH_KS = (1, 2, 3, 4, 6, 8)  # the Ks whose best one is predicted per batch
BATCH_NEW_TOKENS = 32  # new tokens per sequence (B x context bounds the caches' memory)
# the batched drafting methods (the registry's batched ones less "none"; EAGLE as its chain)
BATCH_METHODS = tuple(m for m in methods.BATCH_METHODS if m != "none")

COLUMNS = (("B", "{}", lambda r: r.batch), ("plain tokens/s", "{:.0f}", lambda r: r.plain_tokens_per_s),
           ("speculative tokens/s", "{:.0f}", lambda r: r.spec_tokens_per_s),
           ("measured speedup", "{:.2f}×", lambda r: r.speedup),
           ("predicted (roofline)", "{:.2f}×", lambda r: r.predicted_speedup),
           ("tokens / round", "{:.2f}", lambda r: r.tokens_per_round),
           ("α", "{:.3f}", lambda r: r.acceptance_rate),
           ("step B ms", "{:.2f}", lambda r: r.step_ms),
           ("step B(K+1) ms", "{:.2f}", lambda r: r.verify_step_ms),
           ("best K (predicted)", "{}", lambda r: r.best_k or "off"))


DIALOG_SIZE = (960, 720)
TABLE_MAX_PX = 320  # past this the table scrolls (a GPU's nine batches fit)


def default_batches(device_type: str) -> tuple:
    return GPU_BATCHES if device_type == "cuda" else CPU_BATCHES


def method_problem(method: str, tree_nodes: int = 0) -> Optional[tuple]:
    """(title, message) when the method has no batched form, else None (EAGLE batches its chain only)."""
    if method in BATCH_METHODS and not (method == "eagle" and tree_nodes):
        return None
    now = f"{method}:{tree_nodes}" if tree_nodes else method
    return ("No batched method", "Batched decoding runs the draft model, n-gram drafting or EAGLE's chain; "
                                 f"pick one in the Method menu first (now: {now}).")


def suggestion(report, complete: bool) -> str:
    """The operating point the measurements suggest, or "" (a stopped run, or one batch: no curve)."""
    rows = sorted(report.rows, key=lambda r: r.batch)
    if not complete or len(rows) < 2:
        return ""
    k, last = report.k, rows[-1]
    if all(r.speedup < 1.0 for r in rows):
        best = max(rows, key=lambda r: r.speedup)
        return (f"Speculation <b>off</b> at every batch: it loses even at B = {rows[0].batch} "
                f"(best {best.speedup:.2f}× at B = {best.batch}); plain decoding is faster here.")
    crossover = report.measured_crossover
    if crossover is None:
        predicted = (f"; the roofline puts the crossover at B ≈ {report.predicted_crossover:.0f}"
                     if report.predicted_crossover else "")
        return (f"Speculation <b>on</b> (K = {k}) at every measured batch: still {last.speedup:.2f}× at "
                f"B = {last.batch}{predicted}.")
    return (f"Operating point: speculation <b>on</b> (K = {k}) below B ≈ {crossover:.0f}, <b>off</b> above "
            f"it. At night, with few requests batched together, speculate; in the day's busy hours, with "
            f"batches past {crossover:.0f}, decode plainly.")


# a line's name beside it, never across it: the text's left edge at a vertical line, its bottom on a
# horizontal one, on a patch of the plot's background
BESIDE_VERTICAL = [(-0.05, 0.5), (-0.05, 0.5)]
ABOVE_HORIZONTAL = [(0.0, 1.1), (0.0, 1.1)]


def _vertical(plot, batch: float, name: str, color: str, style, position: float, fill) -> pg.InfiniteLine:
    pen = pg.mkPen(color, width=2, style=style)
    line = pg.InfiniteLine(pos=math.log2(batch), angle=90, movable=False, pen=pen,
                           label=f"{name} B ≈ {batch:.1f}",
                           labelOpts={"position": position, "color": color, "anchors": BESIDE_VERTICAL,
                                      "fill": fill})
    plot.addItem(line)
    return line


def loses_everywhere(rows) -> bool:
    """Speculation slower than plain decoding at every measured batch: there is no crossover to show."""
    return bool(rows) and all(r.speedup < 1.0 for r in rows)


def _fmt_crossover(value: Optional[float], rows=()) -> str:
    if loses_everywhere(rows):
        return "none, speculation loses at every measured batch"
    return "not reached" if value is None else f"B ≈ {value:.1f}"


class BatchDialog(QDialog):
    """The batch regime's result: the plot, the rows and the suggestion (see the module's docstring)."""

    def __init__(self, parent, report, title: str, complete: bool = True, colors: TokenColors = LIGHT):
        super().__init__(parent)
        self.setWindowTitle("Batch regime" if complete else "Batch regime (stopped)")
        self.report, self.complete, self.colors = report, complete, colors
        self.rows = sorted(report.rows, key=lambda r: r.batch)
        self.suggestion_text = suggestion(report, complete)
        self.summary = QLabel(f"{title}<br>{self._verdict()}")
        self.summary.setWordWrap(True)
        self.summary.setTextInteractionFlags(self.summary.textInteractionFlags() | Qt.TextSelectableByMouse)
        self.plot_widget = self._plot()
        self.table = self._table()
        buttons = QDialogButtonBox(QDialogButtonBox.Close)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(self.summary)
        layout.addWidget(self.plot_widget, 3)
        layout.addWidget(self.table, 2)
        layout.addWidget(buttons)
        self.resize(max(DIALOG_SIZE[0], self._table_width() + 40), DIALOG_SIZE[1])

    def _verdict(self) -> str:
        report = self.report
        crossovers = (f"Crossover (speedup below 1): measured "
                      f"{_fmt_crossover(report.measured_crossover, self.rows)}, "
                      f"predicted {_fmt_crossover(report.predicted_crossover)}.")
        if self.suggestion_text:
            return f"{self.suggestion_text}<br>{crossovers}"
        measured = ", ".join(str(r.batch) for r in self.rows)
        why = ("the run was stopped before every batch" if not self.complete
               else "one batch is no curve")
        return f"Measured B = {measured}: {why}, so it suggests no operating point.<br>{crossovers}"

    # ---------------------------------------------------------------------------------------------- plot
    def _plot(self) -> pg.PlotWidget:
        c = self.colors
        widget = pg.PlotWidget(title=f"Speedup against batch size (K = {self.report.k})",
                               background=c.plot_bg)
        plot = widget.getPlotItem()
        plot.setLabel("left", "speculative / plain tokens/s")
        plot.setLabel("bottom", "batch B (log2 axis)")
        plot.showGrid(x=True, y=True, alpha=0.2)
        plot.addLegend(offset=(-10, 10))
        self.unity_line = pg.InfiniteLine(pos=1.0, angle=0, movable=False,
                                          pen=pg.mkPen(c.plot_fg, width=1, style=Qt.DotLine), label="1×",
                                          labelOpts={"position": 0.02, "color": c.plot_fg,
                                                     "anchors": ABOVE_HORIZONTAL})
        plot.addItem(self.unity_line, ignoreBounds=True)
        self.predicted_curve = self._predicted(plot)
        xs = [math.log2(r.batch) for r in self.rows]
        self.measured_curve = plot.plot(xs, [r.speedup for r in self.rows], name="measured",
                                        pen=pg.mkPen(c.running, width=2), symbol="o", symbolSize=8,
                                        symbolBrush=c.running, symbolPen=None)
        self.crossover_line = self._crossover(plot)
        self._ticks(plot)
        return widget

    def _predicted(self, plot):
        from engine.bench.batch import predicted_curve

        report = self.report
        high = max(r.batch for r in self.rows)
        predicted = report.predicted_crossover
        if predicted is not None and high < predicted <= 4 * high:  # show the predicted crossover too
            high = predicted * 1.25
        points = predicted_curve(report, max_batch=high)
        return plot.plot([math.log2(b) for b, _ in points], [s for _, s in points],
                         name="roofline prediction", pen=pg.mkPen(self.colors.predicted, width=2,
                                                                  style=Qt.DashLine))

    def _crossover(self, plot) -> Optional[pg.InfiniteLine]:
        """The measured crossover, a solid vertical line; the predicted one dashed when it is in the plot's
        range (self.predicted_crossover_line, else None)."""
        c, report = self.colors, self.report
        shown = max(float(x) for x in self.predicted_curve.getData()[0]) if self.rows else 0.0
        predicted = report.predicted_crossover
        self.predicted_crossover_line = None
        if predicted is not None and math.log2(predicted) <= shown:
            self.predicted_crossover_line = _vertical(plot, predicted, "predicted crossover", c.predicted,
                                                      Qt.DashLine, 0.75, c.plot_bg)
        if report.measured_crossover is None or loses_everywhere(self.rows):
            return None
        return _vertical(plot, report.measured_crossover, "crossover", c.analytic, Qt.SolidLine, 0.9,
                         c.plot_bg)

    def _ticks(self, plot) -> None:
        """Powers of two labelled as batch sizes; the axis is log2(B)."""
        xs = [float(x) for item in (self.measured_curve, self.predicted_curve) for x in item.getData()[0]]
        top = int(math.ceil(max(xs, default=0.0)))
        plot.getAxis("bottom").setTicks([[(i, str(2 ** i)) for i in range(0, top + 1)]])

    # --------------------------------------------------------------------------------------------- table
    def _table(self) -> QTableWidget:
        table = QTableWidget(len(self.rows), len(COLUMNS))
        table.setHorizontalHeaderLabels([label for label, _, _ in COLUMNS])
        table.verticalHeader().setVisible(False)
        for r, row in enumerate(self.rows):
            for col, (_, fmt, value) in enumerate(COLUMNS):
                table.setItem(r, col, QTableWidgetItem(fmt.format(value(row))))
        table.resizeColumnsToContents()
        rows_height = table.horizontalHeader().sizeHint().height() + sum(
            table.rowHeight(r) for r in range(table.rowCount())) + 2 * table.frameWidth()
        table.setMinimumHeight(min(rows_height, TABLE_MAX_PX))  # every row in sight, up to a point
        return table

    def _table_width(self) -> int:
        """Every column of the table in sight: the dialog is made at least this wide."""
        table = self.table
        scroll_bar = table.verticalScrollBar().sizeHint().width()
        return table.horizontalHeader().length() + 2 * table.frameWidth() + scroll_bar
