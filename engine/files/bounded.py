"""Bounded reads of the files a user names: a size limit checked before reading, and special files that never
end (/dev/zero) or never open (a FIFO nobody writes to) refused with one line instead of hanging or filling
memory. Every reader of a user-named file (a prompt, prompts, a trace, a corpus, a cost model) goes through
here.
"""
from __future__ import annotations

import errno
import os
import select
import stat
import time

from engine.errors import SpecplayError

FIFO_WAIT_S = 2.0  # how long a FIFO may stay without a writer before it is refused
CHUNK = 1 << 20


def mib(limit: int) -> str:
    """A size limit in words: '16 MiB', '100 bytes'."""
    return f"{limit / (1 << 20):g} MiB" if limit >= 1 << 20 else f"{limit} bytes"


def read_bytes(path, what: str, limit: int) -> bytes:
    """The bytes of `path` (at most `limit`), or a SpecplayError naming `what` and the path: a directory, a
    device, a socket, a FIFO without a writer or a file over the limit are refused before they are read."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise SpecplayError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        raise SpecplayError(f"cannot read {what} {path}: it is a directory")
    if stat.S_ISFIFO(mode):
        return _read_fifo(path, what, limit)
    if not stat.S_ISREG(mode):
        kind = "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"
        raise SpecplayError(f"cannot read {what} {path}: {kind} (give a regular file)")
    if os.stat(path).st_size > limit:
        raise SpecplayError(f"{what} {path} is larger than {mib(limit)}")
    try:
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
    except OSError as exc:
        raise SpecplayError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(data) > limit:  # it grew while we read
        raise SpecplayError(f"{what} {path} is larger than {mib(limit)}")
    return data


def _read_fifo(path, what: str, limit: int) -> bytes:
    """A FIFO read without blocking forever: opened non-blocking, refused when no writer sends anything or
    hangs up within FIFO_WAIT_S, and read up to the limit."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise SpecplayError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        return _drain(fd, path, what, limit)
    finally:
        os.close(fd)


def _drain(fd: int, path, what: str, limit: int) -> bytes:
    """Read a non-blocking FIFO to its end. Linux tells apart a FIFO without a writer (a read gives EOF)
    from one whose writer has not written yet (EAGAIN): only the first waits FIFO_WAIT_S at most."""
    chunks, size, writer = [], 0, False
    deadline = time.monotonic() + FIFO_WAIT_S
    while True:
        try:
            chunk = os.read(fd, CHUNK)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise SpecplayError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
            writer = True
            select.select([fd], [], [])  # the writer's own pace: it writes or hangs up
            continue
        if chunk:
            writer = True
            size += len(chunk)
            if size > limit:
                raise SpecplayError(f"{what} {path} is larger than {mib(limit)}")
            chunks.append(chunk)
        elif writer:
            return b"".join(chunks)
        elif time.monotonic() > deadline:
            raise SpecplayError(f"cannot read {what} {path}: a FIFO that nothing writes to "
                                f"(waited {FIFO_WAIT_S:g} s)")
        else:
            time.sleep(0.02)


def read_text(path, what: str, limit: int) -> str:
    """read_bytes decoded as UTF-8 (a BOM dropped); a file that is not UTF-8 is refused naming the line and
    the byte."""
    data = read_bytes(path, what, limit)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise SpecplayError(f"{what} {path}, line {line}: not valid UTF-8 (byte 0x{data[exc.start]:02x} at "
                            f"offset {exc.start})") from None
