"""Live plots (pyqtgraph), redrawn from PlotBuffers one plot per UI tick, at most REDRAW_HZ ticks a second."""
from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPoint, Qt
from PySide6.QtWidgets import QFrame, QGraphicsItem, QGridLayout, QLabel, QSizePolicy, QWidget

from app.plot_data import PlotBuffers, summary_html
from app.style import LIGHT, TokenColors

REDRAW_HZ = 20
AXIS_WIDTH = 52  # px for the y axis: its label and tick labels up to five characters ("12.50", "1000")


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 5 x 10^n that is >= value (value > 0)."""
    if value <= 0:
        return 1.0
    scale = 10.0 ** math.floor(math.log10(value))
    for step in (1.0, 2.0, 5.0, 10.0):
        if step * scale >= value * (1 - 1e-9):
            return step * scale
    return 10.0 * scale


def _array(values) -> np.ndarray:
    return np.asarray(values, dtype=float)


class SummaryLabel(QLabel):
    """The summary text beside the plots. Its text changes on every redraw; a label that asked for a new
    size each time (word wrap asks for a height for its width) would relayout, and so repaint, all five
    plots. This one takes the cell the grid gives it."""

    def __init__(self):
        super().__init__()
        self.setWordWrap(True)
        self.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Ignored)

    def hasHeightForWidth(self) -> bool:
        return False


class PlotPanel(QWidget):
    """Five plots and a summary, each its own widget. The window's UI tick calls `redraw_if_dirty`, which
    redraws at most one stale one (round-robin), so a tick costs one small paint and the event loop stays
    free; full redraws happen on demand (new buffers, export)."""

    def __init__(self, parent=None):
        super().__init__(parent)
        pg.setConfigOptions(antialias=False)  # cheaper paints keep the event loop free
        self.buffers = PlotBuffers()
        self.redraws = 0  # single-plot redraws, for tests
        self.colors = LIGHT
        self.grid = QGridLayout(self)
        self.grid.setContentsMargins(0, 0, 0, 0)
        self.grid.setSpacing(2)
        for column in range(3):
            self.grid.setColumnStretch(column, 1)
        for row in range(2):
            self.grid.setRowStretch(row, 1)
        self._widgets: list = []
        self._build()
        self._next = 0

    # ---------------------------------------------------------------------------------------------- build
    def _build(self) -> None:
        for widget in self._widgets:
            self.grid.removeWidget(widget)
            widget.deleteLater()
        self._widgets = []
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
            "predicted_tpot": self._line(self.tpot_plot, c.predicted, "t_round/E (measured)", dash=True),
            "textbook_tpot": self._line(self.tpot_plot, c.analytic, "TPOT_plain·(1+cK)/E", dash=True),
        }
        self.hist_bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush=c.running)
        self.hist_plot.addItem(self.hist_bars)
        self.pos_bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush=c.per_position)
        self.pos_plot.addItem(self.pos_bars)
        for plot in (self.alpha_plot, self.tpf_plot, self.tpot_plot, self.hist_plot, self.pos_plot):
            self._cache_static_items(plot)
        self.summary = SummaryLabel()
        self.summary.setAlignment(Qt.AlignTop | Qt.AlignLeft)
        self.summary.setStyleSheet(f"background:{c.plot_bg}; color:{c.plot_fg}; padding:8px")
        self.grid.addWidget(self.summary, 1, 2)
        self._widgets.append(self.summary)
        self._painters = [
            lambda: self._draw_curves(self.alpha_plot, "round_alpha", "running_alpha"),
            lambda: self._draw_curves(self.tpf_plot, "round_tpf", "running_tpf", "analytic_tpf",
                                      "per_position_tpf"),
            lambda: self._draw_curves(self.tpot_plot, "round_tpot", "running_tpot", "predicted_tpot",
                                      "textbook_tpot"),
            self._draw_histogram,
            self._draw_positions,
            self._draw_summary,
        ]
        self._drawn = [-1] * len(self._painters)  # buffer version each plot last showed

    def _plot(self, row, col, title, y_label, x_label="round", y_range=None):
        widget = pg.PlotWidget(title=title, background=self.colors.plot_bg)
        widget.setFrameShape(QFrame.NoFrame)
        self.grid.addWidget(widget, row, col)
        self._widgets.append(widget)
        plot = widget.getPlotItem()
        plot.setLabel("left", y_label)
        plot.setLabel("bottom", x_label)
        plot.showGrid(x=True, y=True, alpha=0.2)
        plot.setClipToView(True)
        plot.setDownsampling(auto=True, mode="peak")
        plot.addLegend(offset=(-5, 5), labelTextSize="8pt")
        # axes that never resize with their tick labels never relayout the plot
        for name in ("left", "bottom"):
            plot.getAxis(name).setStyle(autoExpandTextSpace=False, autoReduceTextSpace=False)
        plot.getAxis("left").setWidth(AXIS_WIDTH)
        plot.disableAutoRange()  # ranges are set with the data: auto-range would paint every update twice
        plot.fixed_y = y_range
        self._fit(plot, 10, 1)
        return plot

    @staticmethod
    def _cache_static_items(plot) -> None:
        """Keep axes (with their grid), title and legend as cached pixmaps: a data update then repaints the
        curves only, and the axes are drawn again only when their range changes. This halves a redraw."""
        static = [plot.titleLabel, plot.legend] + [axis["item"] for axis in plot.axes.values()]
        while static:
            item = static.pop()
            item.setCacheMode(QGraphicsItem.DeviceCoordinateCache)
            static.extend(item.childItems())

    @staticmethod
    def _fit(plot, x_max: float, y_max: float, x_min: float = 0.0) -> None:
        """Set the view range, rounded up to 1-2-5 steps and only when it changes: a new range relabels
        the axes, and axis painting is the most expensive part of a redraw."""
        y_low, y_high = plot.fixed_y or (0.0, nice_ceiling(max(y_max, 1e-3) * 1.1))
        wanted = (x_min, max(nice_ceiling(x_max), x_min + 1), y_low, y_high)
        if getattr(plot, "applied_range", None) != wanted:
            plot.setRange(xRange=wanted[:2], yRange=wanted[2:], padding=0.02)
            plot.applied_range = wanted

    def _scatter(self, plot, color, name):
        return plot.plot([], [], pen=None, symbol="o", symbolSize=4, symbolPen=None, symbolBrush=color,
                         name=name)

    def _line(self, plot, color, name, dash=False):
        pen = pg.mkPen(color, width=2, style=Qt.DashLine if dash else Qt.SolidLine)
        return plot.plot([], [], pen=pen, name=name)

    def set_colors(self, colors: TokenColors) -> None:
        self.colors = colors
        self._build()
        self.redraw()

    # ---------------------------------------------------------------------------------------------- data
    def set_buffers(self, buffers: PlotBuffers) -> None:
        """Show other data; the timer redraws the plots one a tick (a full redraw here would stall a
        frame)."""
        self.buffers = buffers
        self._drawn = [-1] * len(self._painters)

    def redraw_if_dirty(self) -> None:
        """One UI tick: redraw the next plot (round-robin) whose data changed since it was drawn."""
        if not self.isVisible():
            return
        count = len(self._painters)
        for step in range(count):
            index = (self._next + step) % count
            if self._drawn[index] != self.buffers.version:
                self._draw(index)
                self._next = index + 1
                return

    def redraw(self) -> None:
        for index in range(len(self._painters)):
            self._draw(index)

    def _draw(self, index: int) -> None:
        self._drawn[index] = self.buffers.version
        self.redraws += 1
        self._painters[index]()

    def _draw_curves(self, plot, *names) -> None:
        x = _array(self.buffers.rounds)
        y_max = 0.0
        for name in names:
            y = _array(getattr(self.buffers, name))
            finite = np.isfinite(y)
            self.curves[name].setData(x[finite], y[finite])
            y_max = max(y_max, float(y[finite].max(initial=0.0)))
        self._fit(plot, len(x), y_max)

    def _draw_histogram(self) -> None:
        lengths = _array(self.buffers.length_counts)
        self.hist_bars.setOpts(x=np.arange(len(lengths)), height=lengths)
        self._fit(self.hist_plot, len(lengths) - 0.5, float(lengths.max(initial=1.0)), x_min=-0.5)
        self._integer_ticks(self.hist_plot, len(lengths))

    def _draw_positions(self) -> None:
        alphas = _array(self.buffers.per_position_acceptance)
        self.pos_bars.setOpts(x=np.arange(1, len(alphas) + 1), height=alphas)
        self._fit(self.pos_plot, len(alphas) + 0.5, 1.0, x_min=0.5)
        self._integer_ticks(self.pos_plot, len(alphas))

    @staticmethod
    def _integer_ticks(plot, bars: int) -> None:
        """Bars sit on whole numbers: tick every one (every other past ten), set only when it changes."""
        step = 1 if bars <= 10 else 2
        if getattr(plot, "tick_step", None) != step:
            plot.getAxis("bottom").setTickSpacing(major=step, minor=step)
            plot.tick_step = step

    def _draw_summary(self) -> None:
        self.summary.setText(summary_html(self.buffers))

    def export(self, path: str) -> None:
        """Save the panel as PNG or SVG (by extension); OSError when the file cannot be written."""
        self.redraw()
        if path.lower().endswith(".svg"):
            self._export_svg(path)
        elif not self.grab().save(path):
            raise OSError(f"cannot write {path}")

    def _export_svg(self, path: str) -> None:
        """The whole panel as vector graphics."""
        from PySide6.QtGui import QPainter
        from PySide6.QtSvg import QSvgGenerator

        generator = QSvgGenerator()
        generator.setFileName(path)
        generator.setSize(self.size())
        generator.setViewBox(self.rect())
        generator.setTitle("specplay plots")
        painter = QPainter(generator)
        try:
            self.render(painter, QPoint())
        finally:
            painter.end()
