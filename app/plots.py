"""Live plots (pyqtgraph), redrawn from PlotBuffers by a QTimer at no more than REDRAW_HZ."""
from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QVBoxLayout, QWidget

from app.plot_data import PlotBuffers
from app.style import LIGHT, TokenColors

REDRAW_HZ = 20


def _array(values) -> np.ndarray:
    return np.asarray(values, dtype=float)


class PlotPanel(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        pg.setConfigOptions(antialias=True)
        self.buffers = PlotBuffers()
        self.redraws = 0
        self.view = pg.GraphicsLayoutWidget()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.view)
        self.colors = LIGHT
        self._build()
        self.timer = QTimer(self)
        self.timer.setInterval(int(1000 / REDRAW_HZ))
        self.timer.timeout.connect(self.redraw_if_dirty)
        self.timer.start()

    # ---------------------------------------------------------------------------------------------- build
    def _build(self) -> None:
        self.view.clear()
        self.view.setBackground(self.colors.plot_bg)
        self.alpha_plot = self._plot(0, 0, "Acceptance rate α per round", "α", y_range=(0, 1.05))
        self.tpf_plot = self._plot(0, 1, "Tokens per target forward", "tokens")
        self.tpot_plot = self._plot(0, 2, "Time per output token", "ms")
        self.hist_plot = self._plot(1, 0, "Accepted length (rounds)", "rounds", x_label="accepted drafts")
        self.pos_plot = self._plot(1, 1, "Acceptance by draft position", "α_i", x_label="position",
                                   y_range=(0, 1.05))
        c = self.colors
        self.curves = {
            "round_alpha": self._scatter(self.alpha_plot, c.measured, "this round"),
            "running_alpha": self._line(self.alpha_plot, c.running, "running mean"),
            "round_tpf": self._scatter(self.tpf_plot, c.measured, "this round"),
            "running_tpf": self._line(self.tpf_plot, c.running, "measured (running)"),
            "analytic_tpf": self._line(self.tpf_plot, c.analytic, "(1−α^(K+1))/(1−α)", dash=True),
            "per_position_tpf": self._line(self.tpf_plot, c.per_position, "1+Σ Π α_j", dash=True),
            "round_tpot": self._scatter(self.tpot_plot, c.measured, "this round"),
            "running_tpot": self._line(self.tpot_plot, c.running, "measured (running)"),
            "predicted_tpot": self._line(self.tpot_plot, c.predicted, "TPOT_plain·(1+cK)/E", dash=True),
        }
        self.hist_bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush=c.running)
        self.hist_plot.addItem(self.hist_bars)
        self.pos_bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush=c.per_position)
        self.pos_plot.addItem(self.pos_bars)
        self.buffers.dirty = True

    def _plot(self, row, col, title, y_label, x_label="round", y_range=None):
        plot = self.view.addPlot(row=row, col=col, title=title)
        plot.setLabel("left", y_label)
        plot.setLabel("bottom", x_label)
        plot.showGrid(x=True, y=True, alpha=0.2)
        plot.addLegend(offset=(-5, 5), labelTextSize="8pt")
        if y_range:
            plot.setYRange(*y_range, padding=0)
        return plot

    def _scatter(self, plot, color, name):
        return plot.plot([], [], pen=None, symbol="o", symbolSize=4, symbolPen=None, symbolBrush=color, name=name)

    def _line(self, plot, color, name, dash=False):
        pen = pg.mkPen(color, width=2, style=pg.QtCore.Qt.DashLine if dash else pg.QtCore.Qt.SolidLine)
        return plot.plot([], [], pen=pen, name=name)

    def set_colors(self, colors: TokenColors) -> None:
        self.colors = colors
        self._build()
        self.redraw()

    # ---------------------------------------------------------------------------------------------- data
    def set_buffers(self, buffers: PlotBuffers) -> None:
        self.buffers = buffers
        buffers.dirty = True

    def redraw_if_dirty(self) -> None:
        if self.buffers.dirty and self.isVisible():
            self.redraw()

    def redraw(self) -> None:
        b = self.buffers
        b.dirty = False
        self.redraws += 1
        x = _array(b.rounds)
        for name, curve in self.curves.items():
            y = _array(getattr(b, name))
            finite = np.isfinite(y)
            curve.setData(x[finite], y[finite])
        lengths = _array(b.length_counts)
        self.hist_bars.setOpts(x=np.arange(len(lengths)), height=lengths)
        alphas = _array(b.per_position_acceptance)
        self.pos_bars.setOpts(x=np.arange(1, len(alphas) + 1), height=alphas)

    def export(self, path: str) -> None:
        """Save the plots as PNG or SVG (by extension); raises OSError when the file cannot be written."""
        self.redraw()
        if path.lower().endswith(".svg"):
            from pyqtgraph.exporters import SVGExporter

            SVGExporter(self.view.ci).export(path)
        elif not self.view.grab().save(path):
            raise OSError(f"cannot write {path}")
