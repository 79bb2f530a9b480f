"""Work-around for reference-count bugs of PySide6 6.12 on Python < 3.12.

There, Qt methods that return nothing (QWidget.update, QPainter.setPen, ...) hand Python a None without taking
a reference to it, and SignalInstance.emit() does the same with the True it returns. Python 3.12+ never frees
None, True or False (they are immortal, PEP 683), so nothing happens there; on 3.11 their counts drain with
every call until the interpreter aborts with "none_dealloc: deallocating None" or "bool_dealloc" (after
seconds of live plotting). When the bug is detected, we give these singletons a reference count they
cannot drain, which makes them as immortal as 3.12 would. The real fix is Python >= 3.12 or a PySide6
without the bug.
"""
from __future__ import annotations

import ctypes
import sys

RESERVE = 1 << 40  # ~1e12 references: decades of Qt calls
SINGLETONS = (None, True, False)


def _drains(obj, call, calls: int = 64) -> bool:
    before = sys.getrefcount(obj)
    for _ in range(calls):
        call()
    return sys.getrefcount(obj) < before - calls // 2


def refcounts_drain() -> bool:
    """True when void calls drain None or emit() drains True (the PySide6 6.12 bug)."""
    from PySide6.QtCore import QObject, Signal

    class _Probe(QObject):
        ping = Signal()

    probe = _Probe()
    return _drains(None, lambda: probe.setObjectName("probe")) or _drains(True, probe.ping.emit)


def protect_singletons() -> bool:
    """Apply the work-around when needed; True if it was applied."""
    if sys.version_info >= (3, 12) or sys.implementation.name != "cpython" or not refcounts_drain():
        return False
    for obj in SINGLETONS:
        ctypes.c_ssize_t.from_address(id(obj)).value += RESERVE
    return True
