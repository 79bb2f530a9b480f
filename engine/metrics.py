"""Running aggregates over RoundEvents, and CSV / JSONL export."""
from __future__ import annotations

import csv
import json
import math
from typing import Iterable

from engine import analytic
from engine.errors import SpecplayError
from engine.events import RoundEvent, RoundMetrics


class Totals:
    """Counts and times added up over rounds, and the one formula for each rate derived from them."""

    def __init__(self, k: int):
        self.k = k  # tokens drafted a round (0 for plain decoding)
        self.rounds = 0
        self.drafted = 0
        self.accepted = 0
        self.emitted = 0
        self.time_ms = 0.0
        self.draft_ms = 0.0
        self.verify_ms = 0.0
        self.overhead_ms = 0.0
        self.length_histogram: list[int] = []  # rounds by accepted count

    def _add(self, rounds: int, drafted: int, accepted: int, emitted: int, draft_ms: float, verify_ms: float,
             overhead_ms: float, time_ms: float) -> None:
        self.rounds += rounds
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
        self.draft_ms += draft_ms
        self.verify_ms += verify_ms
        self.overhead_ms += overhead_ms
        self.time_ms += time_ms

    def _count_lengths(self, histogram: list) -> None:
        """Add a histogram of rounds by accepted count to this one."""
        while len(self.length_histogram) < len(histogram):
            self.length_histogram.append(0)
        for accepted, rounds in enumerate(histogram):
            self.length_histogram[accepted] += rounds

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def tpot_ms(self) -> float:
        return self.time_ms / self.emitted if self.emitted else 0.0

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.emitted / self.time_ms if self.time_ms > 0 else 0.0

    @property
    def analytic_tokens_per_forward(self) -> float:
        """(1 - alpha^(K+1)) / (1 - alpha) at the measured alpha (1 when nothing was drafted)."""
        return analytic.expected_tokens(self.acceptance_rate, self.k if self.drafted else 0)


class MetricsAccumulator(Totals):
    """Aggregates rounds of one generation into RoundMetrics (vLLM's names where they exist)."""

    def __init__(self, k: int):
        super().__init__(k)
        self.position_reached: list[int] = []  # rounds whose draft reached depth i
        self.position_accepted: list[int] = []  # rounds that accepted a token at depth i

    def add_round(self, drafted: int, accepted: int, emitted: int, max_depth: int, draft_ms: float,
                  verify_ms: float, overhead_ms: float) -> RoundMetrics:
        """max_depth: number of draft positions (depths) this round proposed."""
        self._add(1, drafted, accepted, emitted, draft_ms, verify_ms, overhead_ms,
                  draft_ms + verify_ms + overhead_ms)
        for depth in range(max_depth):
            self._grow(depth)
            if accepted >= depth:  # every earlier position was accepted, so this one was tested
                self.position_reached[depth] += 1
                self.position_accepted[depth] += int(accepted > depth)
        self._count_lengths([0] * accepted + [1])
        return self.snapshot()

    def _grow(self, depth: int) -> None:
        while len(self.position_reached) <= depth:
            self.position_reached.append(0)
            self.position_accepted.append(0)

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.position_accepted, self.position_reached)]

    def snapshot(self) -> RoundMetrics:
        return RoundMetrics(
            rounds=self.rounds,
            drafted=self.drafted,
            accepted=self.accepted,
            emitted=self.emitted,
            acceptance_rate=self.acceptance_rate,
            mean_acceptance_length=self.mean_acceptance_length,
            tokens_per_forward=self.tokens_per_forward,
            tpot_ms=self.tpot_ms,
            tokens_per_s=self.tokens_per_s,
            analytic_tokens_per_forward=self.analytic_tokens_per_forward,
            per_position_tokens_per_forward=analytic.expected_tokens_per_position(self.per_position_acceptance),
            per_position_acceptance=self.per_position_acceptance,
            accepted_length_histogram=list(self.length_histogram),
            draft_ms=self.draft_ms, verify_ms=self.verify_ms, overhead_ms=self.overhead_ms,
        )


class RunTotals(Totals):
    """Several whole generations of one configuration added up from their final RoundMetrics (what bench
    reports). Per-position rates cannot be added from rates, so it has none."""

    def __init__(self, k: int):
        super().__init__(k)
        self.generations = 0

    def add(self, metrics: RoundMetrics) -> None:
        """Add one generation: the RoundMetrics of its last round."""
        self.generations += 1
        self._add(metrics.rounds, metrics.drafted, metrics.accepted, metrics.emitted, metrics.draft_ms,
                  metrics.verify_ms, metrics.overhead_ms,
                  metrics.draft_ms + metrics.verify_ms + metrics.overhead_ms)
        self._count_lengths(metrics.accepted_length_histogram)

    @property
    def seconds(self) -> float:
        return self.time_ms / 1000.0


def final_metrics(events: list) -> RoundMetrics:
    """A generation's metrics: its last round's running ones (all zero when it had no round)."""
    return events[-1].metrics if events else RoundMetrics.empty()


# ------------------------------------------------------------------------------------------------ one round
def round_depth(event: RoundEvent) -> int:
    """Draft positions this round proposed (a tree's depth, a chain's length; 0 when nothing was drafted)."""
    return 1 + max((d.depth for d in event.drafted), default=-1)


def round_acceptance(event: RoundEvent) -> float:
    """This round's alpha: accepted / drafted positions (NaN when nothing was drafted)."""
    depths = round_depth(event)
    return event.accepted_count / depths if depths else math.nan


def round_tokens(event: RoundEvent) -> float:
    """Tokens this one target forward emitted."""
    return float(len(event.emitted_ids))


def round_tpot_ms(event: RoundEvent) -> float:
    """This round's time a token it emitted."""
    return event.round_ms / max(1, len(event.emitted_ids))


def histogram_bars(metrics: RoundMetrics) -> list:
    """The accepted-length histogram, a bar for every length up to the deepest draft so far (zeros too)."""
    bars = list(metrics.accepted_length_histogram)
    return bars + [0] * (len(metrics.per_position_acceptance) + 1 - len(bars))


# ------------------------------------------------------------------------------------------------ export
CSV_COLUMNS = [
    ("generation", ""), ("round", ""), ("method", ""), ("k", "tokens"), ("drafted", "tokens"),
    ("accepted", "tokens"), ("emitted", "tokens"), ("next_is_bonus", "bool"), ("draft_ms", "ms"),
    ("verify_ms", "ms"), ("overhead_ms", "ms"), ("round_ms", "ms"), ("acceptance_rate", "ratio"),
    ("mean_acceptance_length", "tokens"), ("tokens_per_forward", "tokens"),
    ("analytic_tokens_per_forward", "tokens"), ("per_position_tokens_per_forward", "tokens"),
    ("tpot_ms", "ms"), ("tokens_per_s", "tokens/s"), ("finish_reason", ""),
]


def csv_header() -> list[str]:
    """Column names with their units, e.g. 'draft_ms [ms]'."""
    return [f"{name} [{unit}]" if unit else name for name, unit in CSV_COLUMNS]


def csv_row(event: RoundEvent, generation: int = 0) -> list:
    m = event.metrics
    values = {
        "generation": generation, "round": event.round, "method": event.method, "k": event.k,
        "drafted": len(event.drafted), "accepted": event.accepted_count, "emitted": len(event.emitted_ids),
        "next_is_bonus": int(event.next_is_bonus), "draft_ms": event.draft_ms, "verify_ms": event.verify_ms,
        "overhead_ms": event.overhead_ms, "round_ms": event.round_ms, "acceptance_rate": m.acceptance_rate,
        "mean_acceptance_length": m.mean_acceptance_length, "tokens_per_forward": m.tokens_per_forward,
        "analytic_tokens_per_forward": m.analytic_tokens_per_forward,
        "per_position_tokens_per_forward": m.per_position_tokens_per_forward, "tpot_ms": m.tpot_ms,
        "tokens_per_s": m.tokens_per_s, "finish_reason": event.finish_reason or "",
    }
    return [_fmt(values[name]) for name, _ in CSV_COLUMNS]


def _fmt(value):
    return f"{value:.6g}" if isinstance(value, float) else value


def _open_for_writing(path):
    try:
        return open(path, "w", newline="", encoding="utf-8")
    except OSError as exc:
        raise SpecplayError(f"cannot write {path}: {exc.strerror or exc}") from None


def write_csv(events: Iterable, path) -> int:
    """One row per round. events: RoundEvents, or (generation, RoundEvent) pairs. Returns the row count."""
    rows = 0
    with _open_for_writing(path) as handle:
        writer = csv.writer(handle)
        writer.writerow(csv_header())
        for item in events:
            generation, event = item if isinstance(item, tuple) else (0, item)
            writer.writerow(csv_row(event, generation))
            rows += 1
    return rows


def write_jsonl(events: Iterable, path) -> int:
    """The full RoundEvents, one JSON object a line. events: RoundEvents or (generation, RoundEvent) pairs."""
    rows = 0
    with _open_for_writing(path) as handle:
        for item in events:
            generation, event = item if isinstance(item, tuple) else (0, item)
            record = {"generation": generation, **event.to_dict()}
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            rows += 1
    return rows
