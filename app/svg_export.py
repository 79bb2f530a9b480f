"""The plots as a plain SVG document, written from the plot buffers (not from Qt's painter).

Qt's SVG generator writes what its painter did (clip paths, transforms, glyph runs), which librsvg and
ImageMagick draw as garbage. This writes plain SVG 1.1 (rect, polyline, circle, text) that every renderer
draws alike. No Qt here.
"""
from __future__ import annotations

import math
import xml.etree.ElementTree as ET

from app.plot_data import PREDICTED_TPOT_LABEL, TEXTBOOK_TPOT_LABEL, robust_top

SVG_NS = "http://www.w3.org/2000/svg"
PANEL_W, PANEL_H = 420, 260
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 52, 12, 28, 58  # the legend sits below the x axis
COLUMNS = 3


def _finite(xs, ys) -> list:
    return [(x, y) for x, y in zip(xs, ys, strict=False) if y is not None and math.isfinite(y)]


def panels(buffers, colors) -> list:
    """(title, y label, x label, series, y range or None); series: (name, kind, colour, [(x, y)])."""
    x = [r + 1 for r in buffers.rounds]
    lengths = buffers.length_counts
    alphas = buffers.per_position_acceptance
    c = colors
    return [
        ("Acceptance rate α per round", "α", "round (from 1)", [
            ("this round", "points", c.measured, _finite(x, buffers.round_alpha)),
            ("running mean", "line", c.running, _finite(x, buffers.running_alpha))], (0.0, 1.05)),
        ("Tokens per target forward", "tokens", "round (from 1)", [
            ("this round", "points", c.measured, _finite(x, buffers.round_tpf)),
            ("running mean", "line", c.running, _finite(x, buffers.running_tpf)),
            ("(1−α^(K+1))/(1−α)", "dash", c.analytic, _finite(x, buffers.analytic_tpf)),
            ("1+Σ Π α_j", "dash", c.per_position, _finite(x, buffers.per_position_tpf))], None),
        ("Time per output token", "ms", "round (from 1)", [
            ("this round", "points", c.measured, _finite(x, buffers.round_tpot)),
            ("running mean", "line", c.running, _finite(x, buffers.running_tpot)),
            (PREDICTED_TPOT_LABEL, "dash", c.predicted, _finite(x, buffers.predicted_tpot)),
            (TEXTBOOK_TPOT_LABEL, "dash", c.analytic, _finite(x, buffers.textbook_tpot))], None),
        ("Accepted length (rounds)", "rounds", "accepted drafts", [
            ("rounds", "bars", c.running, list(enumerate(lengths)))], None),
        ("Acceptance by draft position", "α_i", "draft position (from 1)", [
            ("α_i", "bars", c.per_position, [(i + 1, a) for i, a in enumerate(alphas)])], (0.0, 1.05)),
        ("Tokens per second", "tokens/s", "round (from 1)", [
            ("this round", "points", c.measured, _finite(x, _per_second(buffers.round_tpot))),
            ("running mean", "line", c.running, _finite(x, _per_second(buffers.running_tpot)))], None),
    ]


def _per_second(tpot_ms) -> list:
    return [1000.0 / t if t and t > 0 else math.nan for t in tpot_ms]


def plots_svg(buffers, colors) -> str:
    """The five plots as one SVG document (a string)."""
    items = panels(buffers, colors)
    rows = math.ceil(len(items) / COLUMNS)
    width, height = COLUMNS * PANEL_W, rows * PANEL_H
    root = ET.Element("svg", {"xmlns": SVG_NS, "version": "1.1", "width": str(width), "height": str(height),
                              "viewBox": f"0 0 {width} {height}", "font-family": "sans-serif",
                              "font-size": "11"})
    ET.SubElement(root, "title").text = "specplay plots"
    ET.SubElement(root, "rect", {"x": "0", "y": "0", "width": str(width), "height": str(height),
                                 "fill": colors.plot_bg})
    for index, item in enumerate(items):
        group = ET.SubElement(root, "g", {"transform": f"translate({index % COLUMNS * PANEL_W},"
                                                       f"{index // COLUMNS * PANEL_H})"})
        _panel(group, colors, *item)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _ranges(series, y_range) -> tuple:
    xs = [x for *_, points in series for x, _ in points] or [0, 1]
    bars = any(kind == "bars" for _, kind, _, _ in series)
    x_low, x_high = (min(xs) - 0.5, max(xs) + 0.5) if bars else (min(xs), max(max(xs), min(xs) + 1))
    if y_range is not None:
        return x_low, x_high, y_range[0], y_range[1]
    ys = [y for *_, points in series for _, y in points]
    return x_low, x_high, 0.0, robust_top(ys)


def _panel(group, colors, title, y_label, x_label, series, y_range) -> None:
    x_low, x_high, y_low, y_high = _ranges(series, y_range)
    left, top = MARGIN_L, MARGIN_T
    w, h = PANEL_W - MARGIN_L - MARGIN_R, PANEL_H - MARGIN_T - MARGIN_B

    def sx(x):
        return left + (x - x_low) / ((x_high - x_low) or 1) * w

    def sy(y):
        return top + h - (min(max(y, y_low), y_high) - y_low) / ((y_high - y_low) or 1) * h

    fg = colors.plot_fg
    _text(group, PANEL_W / 2, 16, title, fg, anchor="middle", weight="bold")
    ET.SubElement(group, "rect", {"x": f"{left}", "y": f"{top}", "width": f"{w}", "height": f"{h}",
                                  "fill": "none", "stroke": fg, "stroke-width": "1"})
    for value in _ticks(y_low, y_high):
        _text(group, left - 4, sy(value) + 4, f"{value:g}", fg, anchor="end")
    for value in _ticks(x_low, x_high, whole=True):
        _text(group, sx(value), top + h + 14, f"{value:g}", fg, anchor="middle")
    _text(group, left + w / 2, top + h + 28, x_label, fg, anchor="middle")
    _text(group, 12, top + h / 2, y_label, fg, anchor="middle", rotate=True)
    for _name, kind, color, points in series:
        _series(group, kind, color, points, sx, sy, y_low)
    _legend(group, series, left, top + h + 36, fg)


def _series(group, kind, color, points, sx, sy, y_low) -> None:
    if kind == "points":
        for x, y in points:
            ET.SubElement(group, "circle", {"cx": f"{sx(x):.1f}", "cy": f"{sy(y):.1f}", "r": "2",
                                            "fill": color})
    elif kind == "bars":
        for x, y in points:
            top = sy(y)
            ET.SubElement(group, "rect", {"x": f"{sx(x - 0.4):.1f}", "y": f"{top:.1f}",
                                          "width": f"{sx(x + 0.4) - sx(x - 0.4):.1f}",
                                          "height": f"{max(0.0, sy(y_low) - top):.1f}", "fill": color})
    elif len(points) > 1:
        attributes = {"points": " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points), "fill": "none",
                      "stroke": color, "stroke-width": "2"}
        if kind == "dash":
            attributes["stroke-dasharray"] = "6,4"
        ET.SubElement(group, "polyline", attributes)


def _legend(group, series, x, y, fg) -> None:
    for name, kind, color, _ in series:
        if kind == "points":
            ET.SubElement(group, "circle", {"cx": f"{x + 6}", "cy": f"{y - 4}", "r": "3", "fill": color})
        else:
            attributes = {"x1": f"{x}", "y1": f"{y - 4}", "x2": f"{x + 14}", "y2": f"{y - 4}",
                          "stroke": color, "stroke-width": "3" if kind == "bars" else "2"}
            if kind == "dash":
                attributes["stroke-dasharray"] = "4,3"
            ET.SubElement(group, "line", attributes)
        _text(group, x + 18, y, name, fg)
        x += 24 + 6.2 * len(name)
        if x > PANEL_W - 60:
            x, y = MARGIN_L, y + 14


def _ticks(low: float, high: float, whole: bool = False) -> list:
    span = high - low
    if span <= 0:
        return [low]
    step = 10 ** math.floor(math.log10(span / 4))
    for factor in (1, 2, 5, 10):
        if span / (factor * step) <= 5:
            step *= factor
            break
    if whole:
        step = max(1.0, round(step))
    first = math.ceil(low / step) * step
    return [round(first + i * step, 10) for i in range(int((high - first) / step) + 1)]


def _text(group, x, y, text, color, anchor="start", weight=None, rotate=False) -> None:
    attributes = {"x": f"{x:.1f}", "y": f"{y:.1f}", "fill": color, "text-anchor": anchor}
    if weight:
        attributes["font-weight"] = weight
    if rotate:
        attributes["transform"] = f"rotate(-90 {x:.1f} {y:.1f})"
    ET.SubElement(group, "text", attributes).text = text
