"""The Session menu's exports and import: every round as metrics CSV or a JSONL trace (engine.core.metrics,
engine.files.trace) that reproduces the run, a saved trace read back for replay, the plots as PNG (2x) or
SVG; and
a K or method sweep's table as CSV.

Each export asks `host` (the window) for a path with `host.ask_save_path(title, file_filter)`, reports a
problem with `host.show_error(title, message)` and success with `host.show_status(message, timeout_ms)`;
tests replace the first two on the window. No Qt here.
"""
from __future__ import annotations

from engine.errors import SpecplayError

ROUND_EXPORTS = {  # format -> (title, file filter, suffix)
    "csv": ("Export metrics CSV", "CSV (*.csv)", ".csv"),
    "jsonl": ("Export trace JSONL", "JSON Lines (*.jsonl)", ".jsonl"),
}
OPEN_TITLE = "Open trace"
OPEN_FILTER = "specplay traces (*.jsonl);;All files (*)"
PLOTS_TITLE = "Export plots"
PLOTS_FILTER = "PNG image, 2x (*.png);;SVG drawing (*.svg)"
IMAGE_SUFFIXES = (".png", ".svg")
NOTICE_MS = 5000


def with_suffix(path: str, suffix: str) -> str:
    return path if path.lower().endswith(suffix) else path + suffix


def export_rounds(host, runs: list, fmt: str) -> None:
    """Write runs (engine.files.trace.Run) in `fmt` ('csv' or 'jsonl') to a path the user picks."""
    title, file_filter, suffix = ROUND_EXPORTS[fmt]
    if not runs:
        host.show_error(title, "Nothing to export yet: generate something first.")
        return
    path = host.ask_save_path(title, file_filter)
    if not path:
        return
    path = with_suffix(path, suffix)
    from engine.files.exports import export_runs

    try:  # whole or not at all: a temporary file renamed into place; a path another run writes is refused
        rows = export_runs(path, fmt, runs)
    except SpecplayError as exc:
        host.show_error(title, str(exc))
        return
    host.show_status(f"Wrote {rows} rounds of {len(runs)} generations to {path}", NOTICE_MS)


TABLE_FILTER = "CSV (*.csv)"


def export_table(host, title: str, rows: list) -> None:
    """Write a sweep's measured rows (engine.files.exports.export_table) to a CSV path the user picks."""
    path = host.ask_save_path(title, TABLE_FILTER)
    if not path:
        return
    path = with_suffix(path, ".csv")
    from engine.files.exports import export_table as write

    try:
        written = write(path, rows)
    except SpecplayError as exc:
        host.show_error(title, str(exc))
        return
    host.show_status(f"Wrote {written} rows to {path}", NOTICE_MS)


def read_trace(host, path: str):
    """The runs of the trace at `path`, or None after a dialog said why it cannot be read."""
    import os
    import stat

    from engine.files.trace import read_trace as read

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO or a device would block the GUI thread
            host.show_error(OPEN_TITLE, f"{path} is not a regular file")
            return None
        return read(path)
    except OSError as exc:
        host.show_error(OPEN_TITLE, f"cannot read {path}: {exc.strerror or exc}")
    except SpecplayError as exc:
        host.show_error(OPEN_TITLE, str(exc))
    return None


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
