"""Keep Python's cyclic garbage collector on the GUI thread while a worker runs.

CPython collects in whichever thread trips the allocation threshold, and torch's CUDA-graph capture calls
`gc.collect()` itself. A decoding thread allocates every round, so a collection often ran there, and it
destroyed dead Qt objects (closed windows and their menus, caught in reference cycles) off the GUI thread.
Shiboken then deadlocked: the worker sat in ~QObject holding a Qt lock and waited for the GIL, while the GUI
thread held the GIL and waited for that lock (a CI run hung for 90 minutes; reproduced here and read with gdb
on 2026-11-30).

So while any worker runs, automatic collection is off and the GUI thread collects the young generations on its
UI tick (`collect_young`). Before a worker starts, the GUI thread collects everything once, so no Qt garbage
is left for the worker to free. To keep that collection cheap, the long-lived objects (modules, models, the
window) are frozen out of the collector after each model load (`collect_and_freeze`). With the shipped pair
loaded on this project's 2-core machine, that freeze costs ~0.35 s once per load (338k objects), and the
collection before each generation then takes 0.04 ms instead of ~0.35 s.

No Qt here: this module only deals with `gc` and is used by app/workers.py and the window.
"""
from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holds = 0
_was_enabled = True


def collect_and_freeze() -> None:
    """On the GUI thread, when nothing runs: collect all garbage, then move every live object to the
    permanent generation so later collections skip it (gc.freeze). Unfreezing first lets a replaced model
    be collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def hold() -> None:
    """On the GUI thread, before a worker starts: collect now, then switch automatic collection off."""
    global _holds, _was_enabled
    with _lock:
        if _holds == 0:
            _was_enabled = gc.isenabled()
            gc.collect()
            gc.disable()
        _holds += 1


def release() -> None:
    """After a worker has ended: automatic collection comes back when no worker is left."""
    global _holds
    with _lock:
        if _holds == 0:
            return
        _holds -= 1
        if _holds == 0 and _was_enabled:
            gc.enable()


def held() -> bool:
    return _holds > 0


def collect_young() -> int:
    """On the GUI thread while a worker runs: collect generation 1 or 0 when its count is over its threshold,
    as the automatic collector would. Returns the generation collected, or -1."""
    if not held():
        return -1
    threshold0, threshold1, _ = gc.get_threshold()
    count0, count1, _ = gc.get_count()
    generation = 1 if count1 > threshold1 else 0 if count0 > threshold0 else -1
    if generation >= 0:
        gc.collect(generation)
    return generation
