"""Work-around for a reference-count bug of PySide6 6.12 on Python < 3.12.

There, every Qt method that returns nothing (QWidget.update, QPainter.setPen, ...) hands Python a None without
taking a reference to it. Python 3.12+ never frees None (it is immortal, PEP 683), so nothing happens; on 3.11 the
count of None drains with each call until the interpreter aborts with "none_dealloc: deallocating None" (after a
few seconds of live plotting). When the bug is detected, we give None a reference count it cannot drain, which
makes it as immortal as 3.12 would. The real fix is Python >= 3.12 or a PySide6 without the bug.
"""
from __future__ import annotations

import ctypes
import sys

RESERVE = 1 << 40  # ~1e12 references: decades of Qt calls


def void_calls_leak_none() -> bool:
    from PySide6.QtCore import QObject

    probe = QObject()
    before = sys.getrefcount(None)
    for _ in range(64):
        probe.setObjectName("probe")  # returns nothing
    return sys.getrefcount(None) < before - 32


def protect_none() -> bool:
    """Apply the work-around when needed; True if it was applied."""
    if sys.version_info >= (3, 12) or sys.implementation.name != "cpython" or not void_calls_leak_none():
        return False
    ctypes.c_ssize_t.from_address(id(None)).value += RESERVE
    return True
