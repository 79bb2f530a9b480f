"""The session kept across restarts: the window writes each generation, as a JSONL trace
(engine.files.trace), into
a folder beside its settings file once it ends (and, on close, the one a close cut short), and reads them back
into the History when it opens again, so that closing the window never loses rounds that were not exported.
Session → Clear removes the folder.

One file per generation, numbered in session order: keeping a generation costs its own rounds, not the whole
session's (a session of 50 generations of 41 rounds took 0.45 s to write as one file, on the GUI thread). Each
file is written to a temporary file and renamed (engine.files.exports), so a crash mid-write leaves no half
file.
No Qt here.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Optional

from engine.errors import SpecplayError

SESSION_DIR = "last_session"
UNREADABLE_SUFFIX = ".unreadable"
MAX_REASON_CHARS = 160
_NAME = re.compile(r"^(\d{6})\.jsonl$")


def _numbered(folder: Path) -> list:
    """(number, path) of the kept generations, in order."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def keep(folder: Path, runs: list) -> Optional[str]:
    """Write each run (engine.files.trace.Run) to the next numbered file. Returns a problem's message, or
    None."""
    from engine.files.exports import export_runs

    try:
        folder.mkdir(parents=True, exist_ok=True)
        number = max((n for n, _ in _numbered(folder)), default=0)
        for run in runs:
            number += 1
            export_runs(folder / f"{number:06d}.jsonl", "jsonl", [run])
    except (SpecplayError, OSError) as exc:
        return f"the session could not be kept in {folder}: {exc}"
    return None


def load(folder: Path) -> tuple:
    """(runs, problem): the kept runs in order ([] without a folder). A file that cannot be read or does not
    fit the trace schema (engine.files.schema) is moved aside to its name + '.unreadable' (kept for the user,
    never read again) and the problem names it and why, so that one bad file never stops the window."""
    from engine.files.trace import read_trace

    runs, unreadable = [], []
    for _, path in _numbered(folder):
        try:
            runs.extend(read_trace(path))
        except Exception as exc:  # noqa: BLE001 - whatever the file holds, the window must open
            unreadable.append(f"{_set_aside(path)} ({_reason(exc, path)})")
    problem = None
    if unreadable:
        problem = (f"{len(unreadable)} generation(s) of the last session could not be read; moved aside in "
                   f"{folder}: {'; '.join(unreadable)}")
    return runs, problem


def _set_aside(path: Path) -> str:
    """Rename a kept file that cannot be read to name + '.unreadable'; the name it has now."""
    aside = path.with_name(path.name + UNREADABLE_SUFFIX)
    try:
        path.replace(aside)
    except OSError:
        return path.name
    return aside.name


def _reason(exc: Exception, path: Path) -> str:
    """Why a kept file could not be read, without its folder (the message names it once)."""
    text = str(exc) if isinstance(exc, SpecplayError) else f"{type(exc).__name__}: {exc}"
    return text.replace(f"{path}, ", "").replace(str(path), path.name)[:MAX_REASON_CHARS]


def forget(folder: Path) -> None:
    """Remove the kept session (Session → Clear)."""
    shutil.rmtree(folder, ignore_errors=True)
