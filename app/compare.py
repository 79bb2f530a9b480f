"""Comparing runs: the History's selected runs grouped by settings, with the spread of their tokens/s and the
speedup over TPOT_plain (app.figures); and the TPOT_plain the TPOT plot draws as its reference line.
"""
from __future__ import annotations

import statistics
from typing import Optional

from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableWidget, QTableWidgetItem

from app import figures
from app.session import method_label, sampling_label

# speedup right after the method: in sight in a narrow dock
COLUMNS = ("runs", "method", "speedup", "K", "tokens/s (mean ± sd)", "α", "tokens / forward", "sampling")


def _key(gen) -> tuple:
    c = gen.config
    return gen.prompt, gen.models, c.spec, c.k if c.method != "none" else 0, c.sampling, c.seed


def _speeds(gens) -> list:
    return [g.events[-1].metrics.tokens_per_s for g in gens]


def plain_reference(generations, gen, calibration=None) -> Optional[tuple]:
    """(TPOT_plain ms, label) for the TPOT and tokens/s plots' reference lines (app.figures: a plain run of
    the same prompt and settings, else the calibration, labelled so); None for a plain run itself or
    without either."""
    if gen is None or figures.is_plain(gen):
        return None
    reference = figures.plain_tpot(generations, gen, calibration)
    if reference is None:
        return None
    name = "plain decoding" if reference.measured else "TPOT_plain"
    return reference.ms, f"{name} ({reference.source})"


def compare_rows(selected, generations, calibration=None) -> list:
    """One row per group of equal settings among `selected` (finished runs only), in first-run order."""
    groups: dict = {}
    for gen in figures.finished(selected):
        groups.setdefault(_key(gen), []).append(gen)
    return [_row(gens, generations, calibration) for gens in groups.values()]


def _row(gens: list, generations, calibration=None) -> dict:
    first = gens[0]
    c = first.config
    metrics = [g.events[-1].metrics for g in gens]
    speeds = _speeds(gens)
    reference = figures.plain_tpot(generations, first, calibration)
    drafted = sum(m.drafted for m in metrics)
    return {
        "runs": ", ".join(f"#{g.index}" for g in gens), "count": len(gens), "method": method_label(c),
        "k": None if c.method == "none" else c.k, "sampling": sampling_label(c.sampling, c.seed),
        "alpha": sum(m.accepted for m in metrics) / drafted if drafted and c.method != "none" else None,
        "tokens_per_forward": statistics.fmean(m.tokens_per_forward for m in metrics),
        "tokens_per_s": statistics.fmean(speeds),
        "tokens_per_s_sd": statistics.stdev(speeds) if len(speeds) > 1 else None,
        "speedup": figures.speedup(statistics.fmean(speeds), reference),
        "speedup_source": reference.source if reference is not None else None,
    }


def row_cells(row: dict) -> list:
    spread = f" ± {row['tokens_per_s_sd']:.1f}" if row["tokens_per_s_sd"] is not None else ""
    return [row["runs"], row["method"], _speedup_cell(row), "—" if row["k"] is None else str(row["k"]),
            f"{row['tokens_per_s']:.1f}{spread} (n={row['count']})",
            "—" if row["alpha"] is None else f"{row['alpha']:.3f}", f"{row['tokens_per_forward']:.2f}",
            row["sampling"]]


def _speedup_cell(row: dict) -> str:
    """'1.80×' over measured plain runs; '1.80× (vs calibration)' over the calibration's TPOT_plain."""
    if row["speedup"] is None:
        return "no TPOT_plain"
    if row["speedup_source"] == figures.CALIBRATION:
        return f"{row['speedup']:.2f}× (vs calibration)"
    return f"{row['speedup']:.2f}×"


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

    def refresh(self, generations, selected, calibration=None) -> None:
        chosen = selected if len(selected) > 1 else generations
        self.rows = compare_rows(chosen, generations, calibration)
        self.setRowCount(len(self.rows))
        for r, row in enumerate(self.rows):
            for c, text in enumerate(row_cells(row)):
                self.setItem(r, c, QTableWidgetItem(text))
