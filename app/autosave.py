"""The session kept across restarts: the window writes every generation, as a JSONL trace (engine.trace), next
to its settings file after each generation ends and when it closes, and reads them back into the History when
it opens again, so that closing the window never loses rounds that were not exported. Session → Clear removes
the file. Writes go through engine.exports (a temporary file renamed into place), so a crash mid-write leaves
the previous copy. No Qt here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from engine.errors import SpecplayError

SESSION_FILE = "last_session.jsonl"
UNREADABLE_SUFFIX = ".unreadable"


def save(path: Path, runs: list) -> Optional[str]:
    """Write runs (engine.trace.Run) to path, or remove it when there are none. Returns a problem's
    message, or None."""
    from engine.exports import export_runs

    try:
        if not runs:
            remove(path)
            return None
        export_runs(path, "jsonl", runs)
    except (SpecplayError, OSError) as exc:
        return f"the session could not be kept in {path}: {exc}"
    return None


def load(path: Path) -> tuple:
    """(runs, problem): the saved runs ([] without a file). A file that cannot be read is moved aside to
    path + '.unreadable' (kept for the user, never read again) and the problem says so."""
    from engine.trace import read_trace

    if not path.exists():
        return [], None
    try:
        return read_trace(path), None
    except SpecplayError as exc:
        aside = path.with_name(path.name + UNREADABLE_SUFFIX)
        try:
            path.replace(aside)
        except OSError:
            return [], f"the last session could not be read ({exc})"
        return [], f"the last session could not be read ({exc}); it was moved to {aside}"


def remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
