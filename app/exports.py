"""The Session menu's exports: every round as metrics CSV or a JSONL trace (engine.exports), and the plots
as PNG or SVG.

Each export asks `host` (the window) for a path with `host.ask_save_path(title, file_filter)`, reports a
problem with `host.show_error(title, message)` and success with `host.show_status(message, timeout_ms)`;
tests replace the first two on the window. No Qt here.
"""
from __future__ import annotations

from engine.errors import SpecplayError

ROUND_EXPORTS = {  # format of engine.exports -> (title, file filter)
    "csv": ("Export metrics CSV", "CSV (*.csv)"),
    "jsonl": ("Export trace JSONL", "JSON Lines (*.jsonl)"),
}
PLOTS_TITLE = "Export plots"
PLOTS_FILTER = "PNG image (*.png);;SVG drawing (*.svg)"
IMAGE_SUFFIXES = (".png", ".svg")
NOTICE_MS = 5000


def export_rounds(host, events: list, fmt: str) -> None:
    """Write (generation index, RoundEvent) pairs in `fmt` ('csv' or 'jsonl') to a path the user picks."""
    title, file_filter = ROUND_EXPORTS[fmt]
    if not events:
        host.show_error(title, "Nothing to export yet: generate something first.")
        return
    path = host.ask_save_path(title, file_filter)
    if not path:
        return
    from engine.exports import export_events

    try:  # whole or not at all: a temporary file renamed into place; a path another run writes is refused
        rows = export_events(path, fmt, events)
    except SpecplayError as exc:
        host.show_error(title, str(exc))
        return
    host.show_status(f"Wrote {rows} rounds to {path}", NOTICE_MS)


def image_path(path: str) -> str:
    """The path with an image suffix: PNG unless it already names PNG or SVG."""
    return path if path.lower().endswith(IMAGE_SUFFIXES) else path + ".png"


def export_plots(host, plots, has_plots: bool) -> None:
    """Save the plot panel (`plots.export(path)`) as PNG or SVG, by the suffix of the path the user picks."""
    if not has_plots:
        host.show_error(PLOTS_TITLE, "Nothing to plot yet: generate something first.")
        return
    path = host.ask_save_path(PLOTS_TITLE, PLOTS_FILTER)
    if not path:
        return
    path = image_path(path)
    try:
        with open(path, "ab"):  # an unwritable path raises here; the SVG generator would fail silently
            pass
        plots.export(path)
    except OSError as exc:
        host.show_error(PLOTS_TITLE, f"cannot write {path}: {exc.strerror or exc}")
        return
    host.show_status(f"Wrote plots to {path}", NOTICE_MS)
