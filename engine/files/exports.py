"""Crash-safe, streamed exports of RoundEvents (the CLI's --csv/--trace, the GUI's Session export).

    with StreamingExport(path, csv_format()) as export:   # refuses a path another writer holds
        for event in decoder.generate(prompt, config):
            export.add(event)                               # written and flushed as it arrives

Rows go to a temporary file beside the target (same directory, so the final rename is atomic) and the
target is replaced only when the export ends: readers never see a half-written file, and an earlier run's
file is replaced whole, never left stale. A run that ends early (Ctrl+C, an engine error, a closed window)
still keeps every round it finished: its last row carries the finish reason "stopped" or "error". The
last row is held back until the next one arrives (or the end), so that reason can still be set on it.

A path that exists and is not a regular file (a pipe, /dev/stdout, /dev/full) is written to directly. A
lock file beside the target (`.NAME.lock`, held with fcntl.flock) refuses a second writer of one path.

The formats come from engine.core.metrics (csv_header, csv_row) and engine.files.trace (the header record,
round_record):
their columns and records live there. export_table writes a K or method sweep's table the same way.
"""
from __future__ import annotations

import csv
import errno
import hashlib
import json
import os
import stat
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Callable, Optional

from engine.errors import SpecplayError

STOPPED = "stopped"
ERROR = "error"


class ExportWriteError(SpecplayError):
    """Writing an export failed (a full disk, a vanished folder): the export names itself."""

    def __init__(self, message: str, export: "StreamingExport"):
        super().__init__(message)
        self.export = export


@dataclass(frozen=True)
class ExportFormat:
    """How one export writes: `begin(handle)` once, `header(handle, run_header)` at each generation's start
    (engine.files.trace.make_header's record), then `row(handle, event, generation, run_header)` per round."""

    begin: Callable[[IO], None]
    header: Callable[[IO, dict], None]
    row: Callable[[IO, object, int, Optional[dict]], None]


def csv_format() -> ExportFormat:
    from engine.core.metrics import csv_header, csv_row

    return ExportFormat(begin=lambda handle: csv.writer(handle).writerow(csv_header()),
                        header=lambda handle, run_header: None,
                        row=lambda handle, event, gen, run_header: csv.writer(handle).writerow(
                            csv_row(event, gen, run_header)))


def _jsonl_header(handle: IO, run_header: dict) -> None:
    from engine.files.trace import FORMAT

    handle.write(json.dumps(dict(run_header, type="header", format=FORMAT), ensure_ascii=False) + "\n")


def _jsonl_row(handle: IO, event, generation: int, run_header: Optional[dict]) -> None:
    from engine.files.trace import round_record

    handle.write(json.dumps(round_record(event, generation), ensure_ascii=False) + "\n")


def jsonl_format() -> ExportFormat:
    return ExportFormat(begin=lambda handle: None, header=_jsonl_header, row=_jsonl_row)


FORMATS = {"csv": csv_format, "jsonl": jsonl_format}


def _reason(exc_type) -> Optional[str]:
    """The finish reason of a run that ended by this exception (None: it ended normally)."""
    if exc_type is None:
        return None
    return STOPPED if issubclass(exc_type, (KeyboardInterrupt, SystemExit)) else ERROR


class StreamingExport:
    """A context manager writing one export of (event, generation) rows; see the module's docstring."""

    def __init__(self, path, fmt: ExportFormat):
        if not str(path).strip():
            raise SpecplayError("an export path is empty")
        self.path = Path(path)
        self.fmt = fmt
        self.rows = 0
        self._pending: Optional[tuple] = None  # (event, generation, run header): the row held back
        self._run_header: Optional[dict] = None  # the current generation's header record
        self._handle: Optional[IO] = None
        self._temp: Optional[Path] = None
        self._lock: Optional[_PathLock] = None
        self._closed = False

    # -------------------------------------------------------------------------------------------- public
    def __enter__(self) -> "StreamingExport":
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if isinstance(exc, ExportWriteError) and exc.export is self:
            self.abort()  # this export's own write failed: nothing trustworthy to keep
        else:
            self.close(_reason(exc_type))

    def open(self) -> None:
        """Claim the path, create the temporary file and write the header (all errors: SpecplayError)."""
        try:
            if self._guard(lambda: _is_special(self.path)):
                self._handle = self._guard(lambda: _open_special(self.path))
            else:
                self._guard(self._check_target)
                self._lock = _PathLock.acquire(self.path)
                _remove_orphans(self.path)
                self._handle = self._guard(self._create_temp)
            self._write(lambda: (self.fmt.begin(self._handle), self._handle.flush()))
        except BaseException:
            self.abort()
            raise

    def start_run(self, run_header: dict) -> None:
        """A generation begins: its header record (engine.files.trace.make_header) goes out before its
        rounds."""
        self._write_pending()
        self._run_header = run_header
        self._write(lambda: (self.fmt.header(self._handle, run_header), self._handle.flush()))

    def add(self, event, generation: int = 0) -> None:
        """Queue one round; the one before it is written and flushed now."""
        self._write_pending()
        self._pending = (event, generation, self._run_header)

    def close(self, reason: Optional[str] = None) -> None:
        """Write the held row (with `reason` when the run did not finish itself), then move the file into
        place. Idempotent."""
        if self._closed:
            return
        if reason is not None and self._pending is None and self.rows == 0:
            self.abort()  # the run failed before its first round: the target keeps what it held
            return
        try:
            if self._pending is not None and reason is not None:
                event, gen, run_header = self._pending
                if not getattr(event, "finish_reason", None):
                    self._pending = (replace(event, finish_reason=reason), gen, run_header)
            self._write_pending()
            self._write(self._finish_file)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._release()

    def abort(self) -> None:
        """Drop the temporary file; the target stays as it was. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._handle is not None:
            try:
                self._handle.close()
            except OSError:
                pass
        if self._temp is not None:
            self._temp.unlink(missing_ok=True)
        self._release()

    # --------------------------------------------------------------------------------------- internals
    def _check_target(self) -> None:
        if self.path.is_symlink():  # a link to a file: replace the file, keep the link
            self.path = Path(os.path.realpath(self.path))
        if self.path.is_dir():
            raise SpecplayError(f"cannot write {self.path}: it is a directory")
        if not self.path.parent.is_dir():
            raise SpecplayError(f"cannot write {self.path}: its folder {self.path.parent} does not exist")

    def _create_temp(self) -> IO:
        prefix = f".{_short(self.path.name)}."
        fd, name = tempfile.mkstemp(dir=self.path.parent, prefix=prefix, suffix=".part")
        self._temp = Path(name)
        try:
            os.fchmod(fd, _file_mode(self.path))
        except (AttributeError, OSError):
            pass
        return os.fdopen(fd, "w", newline="", encoding="utf-8")

    def _write_pending(self) -> None:
        if self._pending is None:
            return
        event, gen, run_header = self._pending
        self._pending = None
        self._write(lambda: (self.fmt.row(self._handle, event, gen, run_header), self._handle.flush()))
        self.rows += 1

    def _finish_file(self) -> None:
        handle, self._handle = self._handle, None
        if self._temp is None:  # a special file, written in place
            handle.close()
            return
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()
        os.replace(self._temp, self.path)
        self._temp = None

    def _write(self, action: Callable) -> None:
        self._guard(action)

    def _guard(self, action: Callable):
        try:
            return action()
        except OSError as exc:
            raise ExportWriteError(f"cannot write {self.path}: {exc.strerror or exc}", self) from None

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def _short(name: str) -> str:
    """A file name short enough to take a prefix and a suffix (names are at most 255 bytes)."""
    if len(name.encode("utf-8", "surrogateescape")) <= 200:
        return name
    return hashlib.sha1(name.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def _open_special(path: Path) -> IO:
    """Open a device or a pipe for writing; a pipe nobody reads is an error (ENXIO), not a wait forever."""
    try:
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise OSError(exc.errno, "it is a pipe that no process reads") from None
        raise
    try:
        os.set_blocking(fd, True)
    except (AttributeError, OSError):
        pass
    return os.fdopen(fd, "w", newline="", encoding="utf-8")


def _remove_orphans(target: Path) -> None:
    """Delete temporary files an earlier writer of `target` left when it was killed (we hold the lock now,
    so no live writer owns one)."""
    prefix, suffix = f".{_short(target.name)}.", ".part"

    def is_ours(name: str) -> bool:  # prefix + mkstemp's 8 random characters + suffix
        middle = name[len(prefix):-len(suffix)]
        return name.startswith(prefix) and name.endswith(suffix) and len(middle) == 8 and "." not in middle

    try:
        orphans = [p for p in target.parent.iterdir() if is_ours(p.name)]
    except OSError:
        return
    for path in orphans:
        try:
            path.unlink()
        except OSError:
            pass


def _is_special(path: Path) -> bool:
    """An existing path that is not a regular file or a directory (a device, a pipe, a socket)."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def _file_mode(path: Path) -> int:
    """The mode the finished file gets: the target's own where it exists, else 0o666 less the umask."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


class _PathLock:
    """An exclusive, non-blocking lock on `.NAME.lock` beside a target: one writer per path at a time."""

    def __init__(self, lock_path: Path, fd: int):
        self.lock_path = lock_path
        self.fd = fd

    @classmethod
    def acquire(cls, target: Path) -> "_PathLock":
        lock_path = target.parent / f".{_short(target.name)}.lock"
        for _ in range(5):  # the file may be unlinked by its last holder between our open and our lock
            fd = _open_lock(lock_path, target)
            if _locked_exclusively(fd):
                if _same_file(fd, lock_path):
                    return cls(lock_path, fd)
            else:
                os.close(fd)
                raise SpecplayError(f"cannot write {target}: another run is writing it "
                                    f"(it holds {lock_path})")
            os.close(fd)
        raise SpecplayError(f"cannot write {target}: its lock file {lock_path} keeps changing")

    def release(self) -> None:
        try:
            self.lock_path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)


def _open_lock(lock_path: Path, target: Path) -> int:
    try:
        return os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise SpecplayError(f"cannot write {target}: {exc.strerror or exc}") from None


def _locked_exclusively(fd: int) -> bool:
    try:
        import fcntl
    except ImportError:  # no flock (Windows): no cross-process refusal, the rename still keeps files whole
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except OSError:
        return False


def export_runs(path, fmt: str, runs) -> int:
    """Write runs (engine.files.trace.Run: header, events, finish) in one go; returns the rows written. A run
    that
    ended without a finish of its own (stopped, failed) gets it on its last round."""
    with StreamingExport(path, FORMATS[fmt]()) as export:
        for run in runs:
            export.start_run(run.header)
            for index, event in enumerate(run.events):
                if index == len(run.events) - 1 and run.finish and not event.finish_reason:
                    event = replace(event, finish_reason=run.finish)
                export.add(event, run.generation)
    return export.rows


def export_events(path, fmt: str, events, finish: Optional[str] = None) -> int:
    """Write (generation, RoundEvent) pairs or bare RoundEvents without run headers; returns the rows
    written."""
    with StreamingExport(path, FORMATS[fmt]()) as export:
        for item in events:
            generation, event = item if isinstance(item, tuple) else (0, item)
            export.add(event, generation)
        export.close(finish)
    return export.rows


def export_table(path, rows: list) -> int:
    """Measured rows (dicts: a K or method sweep's) as CSV, crash-safe as every export: one column per key in
    the order the rows first give them, a value a row lacks (or None) left empty. Returns the rows written."""
    columns = list(dict.fromkeys(key for row in rows for key in row))

    def write(handle: IO) -> None:
        writer = csv.writer(handle)
        writer.writerow(columns)
        writer.writerows([["" if row.get(key) is None else row[key] for key in columns] for row in rows])

    with StreamingExport(path, ExportFormat(begin=write, header=lambda handle, run_header: None,
                                            row=lambda handle, event, generation, run_header: None)):
        pass
    return len(rows)
