"""The session kept across restarts: the window writes each generation, as a JSONL trace (engine.trace), into
a folder beside its settings file once it ends (and, on close, the one a close cut short), and reads them back
into the History when it opens again, so that closing the window never loses rounds that were not exported.
Session → Clear removes the folder.

One file per generation, numbered in session order: keeping a generation costs its own rounds, not the whole
session's (a session of 50 generations of 41 rounds took 0.45 s to write as one file, on the GUI thread). Each
file is written to a temporary file and renamed (engine.exports), so a crash mid-write leaves no half file.
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
_NAME = re.compile(r"^(\d{6})\.jsonl$")


def _numbered(folder: Path) -> list:
    """(number, path) of the kept generations, in order."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def keep(folder: Path, runs: list) -> Optional[str]:
    """Write each run (engine.trace.Run) to the next numbered file. Returns a problem's message, or None."""
    from engine.exports import export_runs

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
    """(runs, problem): the kept runs in order ([] without a folder). A file that cannot be read is moved
    aside to its name + '.unreadable' (kept for the user, never read again) and the problem says so."""
    from engine.trace import read_trace

    runs, unreadable = [], []
    for _, path in _numbered(folder):
        try:
            runs.extend(read_trace(path))
        except SpecplayError:
            aside = path.with_name(path.name + UNREADABLE_SUFFIX)
            try:
                path.replace(aside)
            except OSError:
                pass
            unreadable.append(aside.name)
    problem = None
    if unreadable:
        problem = (f"{len(unreadable)} generation(s) of the last session could not be read; moved aside in "
                   f"{folder}: {', '.join(unreadable)}")
    return runs, problem


def forget(folder: Path) -> None:
    """Remove the kept session (Session → Clear)."""
    shutil.rmtree(folder, ignore_errors=True)
