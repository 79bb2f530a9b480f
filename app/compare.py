"""Comparing runs: the History's selected runs grouped by settings, with the spread of their tokens/s and the
speedup over plain decoding of the same prompt; and the plain run the TPOT plot draws as its reference line.
"""
from __future__ import annotations

import statistics
from typing import Optional

from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableWidget, QTableWidgetItem

from app.session import method_label, sampling_label

COLUMNS = ("runs", "method", "K", "speedup", "tokens/s (mean ± sd)", "α", "tokens / forward", "sampling")


def _key(gen) -> tuple:
    c = gen.config
    return gen.prompt, gen.models, c.spec, c.k if c.method != "none" else 0, c.sampling, c.seed


def _finished(generations) -> list:
    return [g for g in generations if g.events and g.finish in ("eos", "length")]


def _speeds(gens) -> list:
    return [g.events[-1].metrics.tokens_per_s for g in gens]


def plain_speed(generations, prompt: str, models: str) -> Optional[float]:
    """Mean tokens/s of the finished plain runs of this prompt on these models, or None."""
    plain = [g for g in _finished(generations)
             if g.config.method == "none" and g.prompt == prompt and g.models == models]
    return statistics.fmean(_speeds(plain)) if plain else None


def plain_reference(generations, gen) -> Optional[tuple]:
    """(TPOT ms, label) of the latest finished plain run of gen's prompt, for the TPOT plot's reference line;
    None when the session has none (or gen is one)."""
    if gen is None or gen.config.method == "none":
        return None
    plain = [g for g in _finished(generations)
             if g.config.method == "none" and g.prompt == gen.prompt and g.models == gen.models]
    if not plain:
        return None
    return plain[-1].events[-1].metrics.tpot_ms, f"plain decoding (#{plain[-1].index})"


def compare_rows(selected, generations) -> list:
    """One row per group of equal settings among `selected` (finished runs only), in first-run order."""
    groups: dict = {}
    for gen in _finished(selected):
        groups.setdefault(_key(gen), []).append(gen)
    return [_row(gens, generations) for gens in groups.values()]


def _row(gens: list, generations) -> dict:
    first = gens[0]
    c = first.config
    metrics = [g.events[-1].metrics for g in gens]
    speeds = _speeds(gens)
    plain = plain_speed(generations, first.prompt, first.models)
    drafted = sum(m.drafted for m in metrics)
    return {
        "runs": ", ".join(f"#{g.index}" for g in gens), "count": len(gens), "method": method_label(c),
        "k": None if c.method == "none" else c.k, "sampling": sampling_label(c.sampling, c.seed),
        "alpha": sum(m.accepted for m in metrics) / drafted if drafted and c.method != "none" else None,
        "tokens_per_forward": statistics.fmean(m.tokens_per_forward for m in metrics),
        "tokens_per_s": statistics.fmean(speeds),
        "tokens_per_s_sd": statistics.stdev(speeds) if len(speeds) > 1 else None,
        "speedup": statistics.fmean(speeds) / plain if plain else None,
    }


def row_cells(row: dict) -> list:
    spread = f" ± {row['tokens_per_s_sd']:.1f}" if row["tokens_per_s_sd"] is not None else ""
    return [row["runs"], row["method"], "—" if row["k"] is None else str(row["k"]),
            "no plain run" if row["speedup"] is None else f"{row['speedup']:.2f}×",
            f"{row['tokens_per_s']:.1f}{spread} (n={row['count']})",
            "—" if row["alpha"] is None else f"{row['alpha']:.3f}", f"{row['tokens_per_forward']:.2f}",
            row["sampling"]]


class CompareTable(QTableWidget):
    """The Compare dock: the selected runs (all finished runs when fewer than two are selected)."""

    def __init__(self, parent=None):
        super().__init__(0, len(COLUMNS), parent)
        self.setHorizontalHeaderLabels(COLUMNS)
        self.verticalHeader().setVisible(False)
        self.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
        self.horizontalHeader().setStretchLastSection(True)
        self.setToolTip("Select runs in History to compare them. Speedup: tokens/s over a plain run "
                        "(Method → Off) of the same prompt in this window's History; ± is the standard "
                        "deviation.")
        self.rows: list = []

    def refresh(self, generations, selected) -> None:
        chosen = selected if len(selected) > 1 else generations
        self.rows = compare_rows(chosen, generations)
        self.setRowCount(len(self.rows))
        for r, row in enumerate(self.rows):
            for c, text in enumerate(row_cells(row)):
                self.setItem(r, c, QTableWidgetItem(text))
