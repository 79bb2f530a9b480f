"""Measure how responsive the window stays while it decodes: the gaps between ticks of a 5 ms QTimer.

    QT_QPA_PLATFORM=offscreen .venv/bin/python scripts/stall_probe.py [--tiny] [--max-new-tokens 120]

Uses throwaway settings, never the user's. Prints the worst gap, the 99th percentile and the five largest
gaps, and where the GUI thread was during gaps longer than --dump-ms (a watchdog thread samples its stack).
Offscreen Qt paints in software, so absolute figures there are pessimistic for a desktop with a GPU
compositor.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


class GapMonitor:
    """Records the time between QTimer ticks; a watchdog thread samples the GUI thread's stack in long
    gaps."""

    def __init__(self, dump_ms: float):
        from PySide6.QtCore import QTimer

        self.gaps: list = []
        self.last = time.perf_counter()
        self.dumps: list = []
        self.dump_s = dump_ms / 1000.0
        self.timer = QTimer()
        self.timer.setInterval(5)
        self.timer.timeout.connect(self._tick)
        self.timer.start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _tick(self) -> None:
        now = time.perf_counter()
        self.gaps.append(now - self.last)
        self.last = now

    def _watch(self) -> None:
        main = threading.main_thread().ident
        while True:
            time.sleep(0.01)
            if time.perf_counter() - self.last > self.dump_s and len(self.dumps) < 5:
                frame = sys._current_frames().get(main)
                self.dumps.append("".join(traceback.format_stack(frame, limit=8)) if frame else "(no frame)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random models instead of the shipped pair")
    parser.add_argument("--max-new-tokens", type=int, default=120)
    parser.add_argument("--dump-ms", type=float, default=60.0)
    parser.add_argument("--warm", action="store_true", help="generate once before measuring a second run")
    args = parser.parse_args()

    from PySide6.QtCore import QSettings, QTimer
    from PySide6.QtWidgets import QApplication

    app = QApplication([])
    # throwaway settings: the user's kept session would be read back (and end the probe at once) and the
    # probe's generation would be kept into it
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, tempfile.mkdtemp(prefix="specplay-probe-"))
    from app import backend
    from app.main_window import GIL_SWITCH_INTERVAL_S, MainWindow

    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as run_gui does

    backend.preload_engine()
    target = draft = None
    if args.tiny:
        from tiny_models import make_tiny_pair

        target, draft = (str(p) for p in make_tiny_pair(Path(tempfile.mkdtemp()) / "pair"))
    window = MainWindow(device="cpu")
    window.show_error = lambda title, message: print(f"error: {title}: {message}")
    window.show()
    window.start(target, draft)
    while window.load_job is not None:
        app.processEvents()
        time.sleep(0.01)
    window.prompt.setPlainText("def add(a, b):\n    return a + b\n")
    window.max_tokens.setValue(args.max_new_tokens)
    if args.warm:
        window.generate()
        while not (window.session.generations and window.session.generations[-1].finish):
            app.processEvents()
            time.sleep(0.005)
    monitor = GapMonitor(args.dump_ms)
    QTimer.singleShot(200, window.generate)
    done = QTimer()
    done.setInterval(50)
    runs = 2 if args.warm else 1
    done.timeout.connect(lambda: app.quit() if len(window.session.generations) == runs and
                         window.session.generations[-1].finish else None)
    done.start()
    QTimer.singleShot(60000, app.quit)
    app.exec()
    gaps = sorted(g * 1000 for g in monitor.gaps[2:])
    print(f"ticks {len(gaps)}; worst gap {gaps[-1]:.0f} ms; p99 {gaps[int(len(gaps) * 0.99)]:.0f} ms; "
          f"largest {[round(g) for g in gaps[-5:]]}")
    for dump in monitor.dumps[:3]:
        print("--- GUI thread during a long gap:\n" + dump)
    return 0


if __name__ == "__main__":
    sys.exit(main())
