"""The Session menu's exports and import: every round as metrics CSV or a JSONL trace (engine.core.metrics,
engine.files.trace) that reproduces the run, a saved trace read back for replay, the plots as PNG (2x) or
SVG; and
a K or method sweep's table as CSV.

Each export asks `host` (the window) for a path with `host.ask_save_path(title, file_filter, name)`, reports a
problem with `host.show_error(title, message)` and success with `host.show_status(message, timeout_ms)`;
tests replace the first two on the window. No Qt here.
"""
from __future__ import annotations

import os
import tempfile
import time
from typing import Optional

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
ROUND_STEMS = {"csv": "metrics", "jsonl": "trace"}
TEXT_TITLE = "Save text"
TEXT_FILTER = "Text (*.txt)"
NOTHING_YET = "Nothing to export yet: generate something first."
NOTICE_MS = 5000


def with_suffix(path: str, suffix: str) -> str:
    return path if path.lower().endswith(suffix) else path + suffix


def proposed_name(stem: str, suffix: str) -> str:
    """The file name a save dialog proposes: the kind of export and the time, never an earlier file's."""
    return f"specplay-{stem}-{time.strftime('%Y%m%d-%H%M%S')}{suffix}"


def ask_export_path(host, title: str, file_filter: str, name: str, fix) -> Optional[str]:
    """The path the user picks (the dialog proposes `name`, in the folder of the last export), made whole
    by `fix` (its suffix); None when the dialog was cancelled."""
    path = host.ask_save_path(title, file_filter, name)
    return fix(path) if path else None


def write_reporting(host, title: str, write, done: str) -> None:
    """Run `write()` (it returns a count); a SpecplayError becomes a dialog, success the status `done`
    with {count} filled in."""
    try:
        count = write()
    except SpecplayError as exc:
        host.show_error(title, str(exc))
        return
    host.show_status(done.format(count=count), NOTICE_MS)


def export_rounds(host, runs: list, fmt: str) -> None:
    """Write runs (engine.files.trace.Run) in `fmt` ('csv' or 'jsonl') to a path the user picks."""
    title, file_filter, suffix = ROUND_EXPORTS[fmt]
    if not runs:
        host.show_error(title, NOTHING_YET)
        return
    path = ask_export_path(host, title, file_filter, proposed_name(ROUND_STEMS[fmt], suffix),
                           lambda p: with_suffix(p, suffix))
    if path:
        from engine.files.exports import export_runs

        # whole or not at all: a temporary file renamed into place; a path another run writes is refused
        write_reporting(host, title, lambda: export_runs(path, fmt, runs),
                        f"Wrote {{count}} rounds of {len(runs)} generations to {path}")


TABLE_FILTER = "CSV (*.csv)"


def export_table(host, title: str, rows: list) -> None:
    """Write a sweep's measured rows (engine.files.exports.export_table) to a CSV path the user picks."""
    stem = title.lower().replace("…", "").strip().replace(" ", "-")
    path = ask_export_path(host, title, TABLE_FILTER, proposed_name(stem, ".csv"),
                           lambda p: with_suffix(p, ".csv"))
    if path:
        from engine.files.exports import export_table as write

        write_reporting(host, title, lambda: write(path, rows), f"Wrote {{count}} rows to {path}")


def save_text(host, text: str) -> None:
    """Session → Save text…: the clean text the model produced (no drafts, no marks) as a UTF-8 file,
    written whole (a temporary file renamed into place) or not at all."""
    if not text:
        host.show_error(TEXT_TITLE, NOTHING_YET)
        return
    path = ask_export_path(host, TEXT_TITLE, TEXT_FILTER, proposed_name("text", ".txt"),
                           lambda p: with_suffix(p, ".txt"))
    if path:
        write_reporting(host, TEXT_TITLE, lambda: _write_whole(path, text),
                        f"Wrote {{count}} characters to {path}")


def _write_whole(path: str, text: str) -> int:
    folder = os.path.dirname(os.path.abspath(path))
    try:
        handle, temporary = tempfile.mkstemp(dir=folder, prefix=".specplay-", suffix=".tmp")
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temporary, path)
    except OSError as exc:
        raise SpecplayError(f"cannot write {path}: {exc.strerror or exc}") from exc
    return len(text)


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
    path = ask_export_path(host, PLOTS_TITLE, PLOTS_FILTER, proposed_name("plots", ".png"), image_path)
    if not path:
        return
    try:
        with open(path, "ab"):  # an unwritable path raises here; the SVG generator would fail silently
            pass
        plots.export(path)
    except OSError as exc:
        host.show_error(PLOTS_TITLE, f"cannot write {path}: {exc.strerror or exc}")
        return
    host.show_status(f"Wrote plots to {path}", NOTICE_MS)
