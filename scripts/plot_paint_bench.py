"""Time one live-plot redraw (data update + paint) with and without a busy Python thread beside it.

    QT_QPA_PLATFORM=offscreen .venv/bin/python scripts/plot_paint_bench.py \\
        [--busy-thread] [--switch-interval S]

A busy pure-Python thread stands in for a decoder thread that holds the GIL; `--switch-interval` sets
sys.setswitchinterval as the app does (app/main_window.py, GIL_SWITCH_INTERVAL_S). Prints the median and worst
milliseconds of the data update and the paint for the three round plots over 150 added rounds.
"""
from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def busy_python() -> None:
    total = 0
    while True:
        for i in range(1000):
            total += i


def add_round(buffers, index: int, rng: random.Random) -> None:
    """Plausible per-round values; the plots only need numbers in range."""
    buffers.rounds.append(index)
    buffers.round_alpha.append(rng.random())
    buffers.running_alpha.append(0.5)
    buffers.round_tpf.append(rng.randint(1, 5))
    buffers.running_tpf.append(2.5)
    buffers.analytic_tpf.append(2.4)
    buffers.per_position_tpf.append(2.3)
    buffers.round_tpot.append(rng.random() * 3)
    buffers.running_tpot.append(1.2)
    buffers.predicted_tpot.append(1.1)
    buffers.version += 1


def summary(values: list) -> str:
    values = sorted(values)
    return f"median {values[len(values) // 2]:.1f} worst {values[-1]:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy-thread", action="store_true")
    parser.add_argument("--switch-interval", type=float, default=None)
    parser.add_argument("--rounds", type=int, default=150)
    args = parser.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    from PySide6.QtWidgets import QApplication

    app = QApplication([])
    from app.plots import PlotPanel

    panel = PlotPanel()
    panel.resize(800, 360)
    panel.show()
    app.processEvents()
    if args.busy_thread:
        threading.Thread(target=busy_python, daemon=True).start()
    rng = random.Random(0)
    update_ms: list = []
    paint_ms: list = []
    for index in range(1, args.rounds + 1):
        add_round(panel.buffers, index, rng)
        for plot in range(3):
            start = time.perf_counter()
            panel._draw(plot)
            drawn = time.perf_counter()
            panel.grid.itemAt(plot).widget().viewport().repaint()
            update_ms.append((drawn - start) * 1000)
            paint_ms.append((time.perf_counter() - drawn) * 1000)
    print(f"switch interval {sys.getswitchinterval() * 1000:.1f} ms, busy thread {args.busy_thread}: "
          f"data update ms {summary(update_ms)}; paint ms {summary(paint_ms)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
