"""Live plots (pyqtgraph), redrawn from PlotBuffers one plot per UI tick, at most REDRAW_HZ ticks a second."""
from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPoint, Qt
from PySide6.QtGui import QPixmap
from PySide6.QtWidgets import (
    QFrame,
    QGraphicsItem,
    QGridLayout,
    QLabel,
    QScrollArea,
    QSizePolicy,
    QStackedLayout,
    QTabWidget,
    QWidget,
)

from app.plot_data import PREDICTED_TPOT_LABEL, TEXTBOOK_TPOT_LABEL, PlotBuffers, robust_top, summary_html
from app.style import LIGHT, TokenColors

REDRAW_HZ = 20
AXIS_WIDTH = 52  # px for the y axis: its label and tick labels up to five characters ("12.50", "1000")
PNG_SCALE = 2  # exported PNGs have twice the screen's pixels
# compared runs: hues apart from the plots' own curves (red, purple, green, blue), drawn wider
OVERLAY_COLORS = ("#e8590c", "#1098ad", "#f08c00", "#795548", "#495057", "#0b7285")
OVERLAY_WIDTH = 3
NUMBERING = "Rounds, generations and draft positions count from 1."
# the running curve each plot overlays for a compared run (PlotBuffers attribute)
OVERLAY_SERIES = {"alpha": "running_alpha", "tpf": "running_tpf", "tpot": "running_tpot",
                  "tps": "running_tps"}
GRID_COLUMNS = 12  # top row: three plots of 4 columns; bottom row: three plots and the summary, 3 each
ROW_STRETCH = (5, 3)  # the top row's three main plots get five eighths of the panel's height
TITLE_SIZE = "10pt"  # the plots' titles: smaller than pyqtgraph's default, more room for the data
LEGEND_SAMPLE_PX = 28  # a legend entry's line sample and the gap before its text
LEGEND_MARGIN_PX = 14  # the legend box's margins


class WholeNumberAxis(pg.AxisItem):
    """An x axis of counts (rounds, draft positions, accepted lengths): ticks on whole numbers only, so a
    short run's axis reads 1 2 3, never 1.5 or 2.5."""

    def tickSpacing(self, minVal: float, maxVal: float, size: float):
        levels = [(spacing, offset) for spacing, offset in super().tickSpacing(minVal, maxVal, size)
                  if spacing >= 1 and float(spacing).is_integer()]
        return levels or [(1.0, 0.0)]


class PlotCell(pg.PlotWidget):
    """One plot of the panel; its legend (below the x axis) takes as many columns as its width holds, so
    the legend wraps instead of running past the plot's right edge."""

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        fit_legend(self.getPlotItem(), self.width())


def fit_legend(plot, width: float) -> None:
    """Lay the legend's entries out row by row in as many columns as `width` holds (at least one)."""
    legend = getattr(plot, "legend", None)  # None while the widget is being built
    if legend is None or not legend.items:
        return
    spacing = legend.layout.horizontalSpacing()
    entries = [LEGEND_SAMPLE_PX + label.item.boundingRect().width() + spacing for _, label in legend.items]
    columns = next((n for n in range(len(entries), 1, -1)
                    if _columns_width(entries, n) <= width - LEGEND_MARGIN_PX), 1)
    legend.setColumnCount(columns)


def _columns_width(entries: list, columns: int) -> float:
    """The width of `entries` laid out row by row in `columns` columns, each as wide as its widest."""
    return sum(max(entries[column::columns]) for column in range(columns))


def series(buffers, name: str) -> np.ndarray:
    """A plotted series of the buffers; tokens/s derive from TPOT (1000 / ms per token)."""
    if name in ("round_tps", "running_tps"):
        tpot = _array(getattr(buffers, name.replace("tps", "tpot")))
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(tpot > 0, 1000.0 / tpot, np.nan)
    return _array(getattr(buffers, name))


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 5 x 10^n that is >= value (value > 0)."""
    if value <= 0:
        return 1.0
    scale = 10.0 ** math.floor(math.log10(value))
    for step in (1.0, 2.0, 5.0, 10.0):
        if step * scale >= value * (1 - 1e-9):
            return step * scale
    return 10.0 * scale


def _stepped(value: float, previous, low: float = 0.0, headroom: float = 1.2) -> float:
    """`value` with `headroom`, rounded up to a fortieth of the span (1-2-5); `previous` kept while it still
    covers value and is not too large for it. Growing data then moves the range about log(n)/log(headroom)
    times, not at every point; headroom 1 fits the data exactly."""
    if previous is not None and value <= previous <= low + max(headroom, 1.05) * 1.1 * (value - low) + 1e-9:
        return previous
    span = headroom * (value - low)
    step = nice_ceiling(span / 40)
    return low + math.ceil(span / step - 1e-9) * step


def _array(values) -> np.ndarray:
    return np.asarray(values, dtype=float)


def clip_outliers(y: np.ndarray, top: float) -> tuple:
    """(y with values above `top` removed, mask of the clipped ones) for a scatter on a robust range."""
    over = np.isfinite(y) & (y > top)
    return np.where(over, np.nan, y), over


class SummaryArea(QScrollArea):
    """The summary text beside the plots, scrolled where it is taller than its cell. Its text changes on
    every redraw; a label in the grid that asked for a new size each time (word wrap asks for a height for
    its width) would relayout, and so repaint, all five plots. Inside a scroll area its new height only
    moves the scroll bar: the area takes the cell the grid gives it."""

    def __init__(self, label: QLabel):
        super().__init__()
        self.setWidget(label)
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Ignored)


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
        self.overlays: list = []  # [(label, PlotBuffers)] of compared runs
        self.reference = None  # (TPOT ms, label) of a plain run: the reference line on the TPOT plot
        self.compact = False  # True: one plot at a time, in tabs (small windows)
        self.stack = QStackedLayout(self)
        self.grid_page = QWidget()
        self.grid = QGridLayout(self.grid_page)
        self.grid.setContentsMargins(0, 0, 0, 0)
        self.grid.setSpacing(2)
        for column in range(GRID_COLUMNS):
            self.grid.setColumnStretch(column, 1)
        for row, stretch in enumerate(ROW_STRETCH):
            self.grid.setRowStretch(row, stretch)
        self.tabs = QTabWidget()
        self.tabs.setDocumentMode(True)
        self.tabs.currentChanged.connect(lambda _: self.redraw_if_dirty())
        self.stack.addWidget(self.grid_page)
        self.stack.addWidget(self.tabs)
        self._widgets: list = []
        self.plot_widgets: list = []
        self._build()
        self._next = 0

    # ---------------------------------------------------------------------------------------------- build
    def _build(self) -> None:
        self.tabs.clear()
        for widget in self._widgets:
            self.grid.removeWidget(widget)
            widget.deleteLater()
        self._widgets, self.plot_widgets = [], []
        # every count starts at 1 (NUMBERING), and the axes say so; cells: (row, column, columns spanned)
        self.alpha_plot = self._plot((0, 0, 4), "Acceptance rate α per round", "α", y_range=(0, 1.05))
        self.tpf_plot = self._plot((0, 4, 4), "Tokens per target forward", "tokens")
        self.tpot_plot = self._plot((0, 8, 4), "Time per output token", "ms")
        self.hist_plot = self._plot((1, 0, 3), "Accepted length (rounds)", "rounds",
                                    x_label="accepted drafts", legend=False)
        self.pos_plot = self._plot((1, 3, 3), "Acceptance by draft position", "α_i",
                                   x_label="draft position (from 1)", y_range=(0, 1.05), legend=False)
        # the same marks as the TPOT plot's, whose legend names them: no legend row taking its little height
        self.tps_plot = self._plot((1, 6, 3), "Tokens per second", "tokens/s", legend=False)
        c = self.colors
        self.curves = {
            "round_alpha": self._scatter(self.alpha_plot, c.measured, "this round"),
            "running_alpha": self._line(self.alpha_plot, c.running, "running mean"),
            "round_tpf": self._scatter(self.tpf_plot, c.measured, "this round"),
            "running_tpf": self._line(self.tpf_plot, c.running, "running mean"),
            "analytic_tpf": self._line(self.tpf_plot, c.analytic, "(1−α^(K+1))/(1−α)", dash=True),
            "per_position_tpf": self._line(self.tpf_plot, c.per_position, "1+Σ Π α_j", dash=True),
            "round_tpot": self._scatter(self.tpot_plot, c.measured, "this round"),
            "running_tpot": self._line(self.tpot_plot, c.running, "running mean"),
            "predicted_tpot": self._line(self.tpot_plot, c.predicted, PREDICTED_TPOT_LABEL, dash=True),
            "textbook_tpot": self._line(self.tpot_plot, c.analytic, TEXTBOOK_TPOT_LABEL, dash=True),
            "round_tps": self._scatter(self.tps_plot, c.measured, "this round"),
            "running_tps": self._line(self.tps_plot, c.running, "running mean"),
        }
        self.clipped = {name: self._clipped_marks(plot) for name, plot in
                        (("round_tpf", self.tpf_plot), ("round_tpot", self.tpot_plot),
                         ("round_tps", self.tps_plot))}
        self.reference_lines = {key: self._reference_line(plot, c) for key, plot in
                                (("tpot", self.tpot_plot), ("tps", self.tps_plot))}
        self.reference_line = self.reference_lines["tpot"]
        self.overlay_curves: dict = {}  # (plot key, overlay index) -> curve
        self.hist_bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush=c.running)
        self.hist_plot.addItem(self.hist_bars)
        self.pos_bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush=c.per_position)
        self.pos_plot.addItem(self.pos_bars)
        for plot in (self.alpha_plot, self.tpf_plot, self.tpot_plot, self.hist_plot, self.pos_plot,
                     self.tps_plot):
            self._cache_static_items(plot)
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.summary.setAlignment(Qt.AlignTop | Qt.AlignLeft)
        self.summary.setStyleSheet(f"background:{c.plot_bg}; color:{c.plot_fg}; padding:8px")
        self.summary_area = SummaryArea(self.summary)
        self._widgets.append(self.summary_area)
        self._place_widgets()
        self._painters = [
            lambda: self._draw_curves(self.alpha_plot, "alpha", "round_alpha", "running_alpha"),
            lambda: self._draw_curves(self.tpf_plot, "tpf", "round_tpf", "running_tpf", "analytic_tpf",
                                      "per_position_tpf"),
            lambda: self._draw_curves(self.tpot_plot, "tpot", "round_tpot", "running_tpot", "predicted_tpot",
                                      "textbook_tpot"),
            self._draw_histogram,
            self._draw_positions,
            lambda: self._draw_curves(self.tps_plot, "tps", "round_tps", "running_tps"),
            self._draw_summary,
        ]
        self._drawn = [-1] * len(self._painters)  # buffer version each plot last showed

    @staticmethod
    def _reference_line(plot, colors):
        """A plain run's value (TPOT, tokens/s) as a dotted horizontal line, named in the legend (a name
        drawn beside the line would lie over the curves). `line.sample` is its legend entry."""
        pen = pg.mkPen(colors.plot_fg, width=1, style=Qt.DotLine)
        line = pg.InfiniteLine(angle=0, movable=False, pen=pen)
        line.setVisible(False)
        line.sample = pg.PlotDataItem([], [], pen=pen)  # only a legend sample: it holds no data
        plot.addItem(line, ignoreBounds=True)
        return line

    def _plot(self, cell, title, y_label, x_label="round (from 1)", y_range=None, legend=True):
        """One plot in its grid cell; `legend` False: a plot of bars, whose legend would be empty (its row
        would only take height from the data)."""
        widget = PlotCell(background=self.colors.plot_bg, axisItems={"bottom": WholeNumberAxis("bottom")})
        widget.setFrameShape(QFrame.NoFrame)
        widget.grid_cell = (cell[0], cell[1], 1, cell[2])
        self._widgets.append(widget)
        self.plot_widgets.append(widget)
        plot = widget.getPlotItem()
        plot.setLabel("left", y_label)
        plot.setLabel("bottom", x_label)
        plot.showGrid(x=True, y=True, alpha=0.2)
        plot.setClipToView(True)
        plot.setDownsampling(auto=True, mode="peak")
        plot.legend = pg.LegendItem(colCount=3, labelTextSize="8pt", verSpacing=-8, horSpacing=10)
        plot.legend.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)  # never widens the plot
        plot.legend.setMinimumWidth(1)
        plot.titleLabel.updateMin = lambda: None  # pyqtgraph pins the minimum width to the title's
        plot.titleLabel.setMinimumWidth(1)  # a long title is clipped, never widening the plot
        plot.setTitle(title, size=TITLE_SIZE)
        if legend:
            plot.layout.addItem(plot.legend, 4, 0, 1, 2)  # below the x axis (full width): never over the data
        # axes that never resize with their tick labels never relayout the plot; no "(x0.001)" multipliers
        for name in ("left", "bottom"):
            plot.getAxis(name).setStyle(autoExpandTextSpace=False, autoReduceTextSpace=False)
            plot.getAxis(name).enableAutoSIPrefix(False)
        plot.getAxis("left").setWidth(AXIS_WIDTH)
        plot.disableAutoRange()  # ranges are set with the data: auto-range would paint every update twice
        plot.fixed_y = y_range
        plot.readout = pg.TextItem(color=self.colors.plot_fg, anchor=(0, 0))
        plot.readout.setZValue(10)
        plot.addItem(plot.readout, ignoreBounds=True)
        plot.scene().sigMouseMoved.connect(lambda pos, p=plot: self._hover(p, pos))
        self._fit(plot, 10, 1)
        return plot

    def _place_widgets(self) -> None:
        """The plots and the summary in the grid (a large panel) or in tabs (compact)."""
        for widget in self._widgets:
            if self.compact:
                title = "Summary" if widget is self.summary_area else widget.getPlotItem().titleLabel.text
                self.tabs.addTab(widget, title)
            else:
                self.grid.addWidget(widget, *getattr(widget, "grid_cell", (1, 9, 1, 3)))
                widget.show()  # the tabs hid every page but the current one: back in the grid, all show
        self.stack.setCurrentIndex(1 if self.compact else 0)

    def set_compact(self, compact: bool) -> None:
        """Small windows: one plot at a time in tabs; large ones: all five and the summary in a grid."""
        if compact == self.compact:
            return
        self.compact = compact
        if not compact:
            self.tabs.clear()
        self._place_widgets()
        self._drawn = [-1] * len(self._painters)

    def _clipped_marks(self, plot):
        """Where a round's value lies above the robust range: a triangle at the top edge."""
        return plot.plot([], [], pen=None, symbol="t1", symbolSize=7, symbolPen=None,
                         symbolBrush=self.colors.analytic)

    # ---------------------------------------------------------------------------------------------- hover
    def _hover(self, plot, scene_pos) -> None:
        """A readout of the values at the round (or bar) under the mouse, in the plot's top-left corner."""
        box = plot.vb
        if not box.sceneBoundingRect().contains(scene_pos):
            plot.readout.setText("")
            return
        x = box.mapSceneToView(scene_pos).x()
        plot.readout.setText(self.readout(plot, x))
        (x_low, _), (_, y_high) = box.viewRange()
        plot.readout.setPos(x_low, y_high)

    def readout(self, plot, x: float) -> str:
        """The text the hover readout shows at x on `plot`."""
        index = int(round(x))
        if plot is self.hist_plot:
            counts = self.buffers.length_counts
            return f"{index} accepted: {counts[index]} rounds" if 0 <= index < len(counts) else ""
        if plot is self.pos_plot:
            alphas = self.buffers.per_position_acceptance
            return f"position {index}: α_i = {alphas[index - 1]:.3f}" if 1 <= index <= len(alphas) else ""
        names = {self.alpha_plot: ("round_alpha", "running_alpha"),
                 self.tpf_plot: ("round_tpf", "running_tpf"),
                 self.tpot_plot: ("round_tpot", "running_tpot"),
                 self.tps_plot: ("round_tps", "running_tps")}[plot]
        values = [series(self.buffers, name) for name in names]
        if not 1 <= index <= len(values[0]):
            return ""
        this, running = (v[index - 1] for v in values)
        return f"round {index}: {this:.3g} (running {running:.3g})"

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
    def _fit(plot, x_max: float, y_max: float, x_min: float = 0.5, live: bool = False) -> None:
        """Set the view range to the data (x) and to a robust top (y), only when it changes: a new range
        relabels the axes, and axis painting is the most expensive part of a redraw. So both ends move in
        steps (a twentieth of the range, rounded to 1-2-5) and a top that would shrink by less than a quarter
        stays: while a run grows, the axes relabel every few rounds, not every round."""
        previous = getattr(plot, "applied_range", None)
        headroom = 1.2 if live else 1.0  # a finished run fits its rounds exactly
        kept = previous[1] if previous and live else None
        x_high = _stepped(max(x_max, x_min + 1), kept, x_min, headroom)
        if plot.fixed_y:
            y_low, y_high = plot.fixed_y
        else:
            y_low, y_high = 0.0, _stepped(max(y_max, 1e-3), previous[3] if previous else None, 0.0, 1.05)
        wanted = (x_min, x_high, y_low, y_high)
        if previous != wanted:
            plot.setRange(xRange=wanted[:2], yRange=wanted[2:], padding=0.01)
            plot.applied_range = wanted

    def _scatter(self, plot, color, name):
        curve = plot.plot([], [], pen=None, symbol="o", symbolSize=4, symbolPen=None, symbolBrush=color)
        plot.legend.addItem(curve, name)
        return curve

    def _line(self, plot, color, name, dash=False, width=2):
        pen = pg.mkPen(color, width=width, style=Qt.DashLine if dash else Qt.SolidLine)
        curve = plot.plot([], [], pen=pen)
        plot.legend.addItem(curve, name)
        return curve

    def set_colors(self, colors: TokenColors) -> None:
        self.colors = colors
        self._build()
        self.redraw()

    # ---------------------------------------------------------------------------------------------- data
    def set_buffers(self, buffers: PlotBuffers, overlays: list = ()) -> None:
        """Show other data, and the running curves of `overlays` ([(label, PlotBuffers)], compared runs) over
        it; the timer redraws the plots one a tick (a full redraw here would stall a frame)."""
        self.buffers = buffers
        if list(overlays) != self.overlays:
            self._set_overlays(list(overlays))
        self._drawn = [-1] * len(self._painters)

    def set_reference(self, tpot_ms, label: str = "plain decoding") -> None:
        """Horizontal lines at a plain run's TPOT and tokens/s (None hides them)."""
        self.reference = None if tpot_ms is None else (float(tpot_ms), label)
        values = {"tpot": tpot_ms, "tps": 1000.0 / tpot_ms if tpot_ms else None}
        for key, line in self.reference_lines.items():
            shown = self.reference is not None and values[key] is not None
            line.setVisible(shown)
            legend = self._plots_by_key()[key].legend
            legend.removeItem(line.sample)
            if shown:
                line.setPos(values[key])
                legend.addItem(line.sample, label)
        self._fit_legends()
        self._drawn = [-1] * len(self._painters)

    def _set_overlays(self, overlays: list) -> None:
        for (key, _), curve in self.overlay_curves.items():
            plot = self._plots_by_key()[key]
            plot.removeItem(curve)
            plot.legend.removeItem(curve)
        self.overlay_curves = {}
        self.overlays = overlays
        for index, (label, buffers) in enumerate(overlays):
            color = OVERLAY_COLORS[index % len(OVERLAY_COLORS)]
            for key, plot in self._plots_by_key().items():
                curve = self._line(plot, color, label, width=OVERLAY_WIDTH)
                self.overlay_curves[(key, index)] = curve
                if not np.isfinite(series(buffers, OVERLAY_SERIES[key])).any():
                    plot.legend.removeItem(curve)  # a plain run has no α: no legend entry for no line
        self._fit_legends()

    def _fit_legends(self) -> None:
        for widget in self.plot_widgets:
            fit_legend(widget.getPlotItem(), widget.width())

    def _plots_by_key(self) -> dict:
        return {"alpha": self.alpha_plot, "tpf": self.tpf_plot, "tpot": self.tpot_plot, "tps": self.tps_plot}

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

    def _draw_curves(self, plot, key: str, *names) -> None:
        """A plot's curves over rounds counted from 1; scatter outliers above the robust top are clipped and
        marked with a triangle at the top edge."""
        x = _array(self.buffers.rounds) + 1
        x_max = float(x[-1]) if len(x) else 1.0
        values = {name: series(self.buffers, name) for name in names}
        overlays = [series(b, OVERLAY_SERIES[key]) for _, b in self.overlays]
        top = robust_top(np.concatenate([v for v in values.values()] + overlays + [np.zeros(1)]).tolist())
        line = self.reference_lines.get(key)
        if line is not None and line.isVisible():
            top = max(top, line.value() * 1.1)
        for name, y in values.items():
            if name in self.clipped:
                y, over = clip_outliers(y, top)
                self.clipped[name].setData(x[over], np.full(int(over.sum()), top * 0.98))
            finite = np.isfinite(y)
            self.curves[name].setData(x[finite], y[finite])
        for index, y in enumerate(overlays):
            ox = np.arange(1, len(y) + 1, dtype=float)
            finite = np.isfinite(y)
            self.overlay_curves[(key, index)].setData(ox[finite], y[finite])
            x_max = max(x_max, float(len(y)))
        last = self.buffers.last_event
        self._fit(plot, x_max + 0.5, top, live=last is not None and not last.finished)

    def _draw_histogram(self) -> None:
        lengths = _array(self.buffers.length_counts)
        self.hist_bars.setOpts(x=np.arange(len(lengths)), height=lengths)
        self._fit(self.hist_plot, len(lengths) - 0.5, 1.1 * float(lengths.max(initial=1.0)), x_min=-0.5)
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
        """Save the panel as PNG (at PNG_SCALE times the screen's pixels) or SVG (by extension); OSError
        when the file cannot be written."""
        self.redraw()
        if path.lower().endswith(".svg"):
            from app.svg_export import plots_svg

            with open(path, "w", encoding="utf-8") as handle:
                handle.write(plots_svg(self.buffers, self.colors))
        elif not self.render_png(PNG_SCALE).save(path):
            raise OSError(f"cannot write {path}")

    def render_png(self, scale: int) -> QPixmap:
        """The grid of plots drawn at `scale` times its size (tabs or not)."""
        compact = self.compact
        self.set_compact(False)
        page = self.grid_page
        pixmap = QPixmap(page.size() * scale)
        pixmap.setDevicePixelRatio(scale)
        pixmap.fill(Qt.white)
        page.render(pixmap, QPoint())
        self.set_compact(compact)
        return pixmap
