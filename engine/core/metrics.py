"""Running aggregates over RoundEvents, and CSV / JSONL export."""
from __future__ import annotations

import csv
import json
import math
from typing import Iterable

from engine.analysis import analytic
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
        while len(self.length_histogram) <= accepted:
            self.length_histogram.append(0)
        self.length_histogram[accepted] += 1
        return self.snapshot()

    def _grow(self, depth: int) -> None:
        while len(self.position_reached) <= depth:
            self.position_reached.append(0)
            self.position_accepted.append(0)

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.position_accepted, self.position_reached)]

    def snapshot(self) -> RoundMetrics:
        per_position = self.per_position_acceptance
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
            per_position_tokens_per_forward=analytic.expected_tokens_per_position(per_position),
            per_position_acceptance=per_position,
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
# Rounds count from 1 here, as everywhere a user reads them (RoundEvent.round and the JSONL trace keep 0).
SETTINGS_COLUMNS = [
    ("method", ""), ("k", "tokens"), ("temperature", ""), ("top_k", ""), ("top_p", ""), ("seed", ""),
    ("tree_nodes", "nodes"), ("target", ""), ("draft", ""), ("device", ""), ("dtype", ""),
    ("synthetic_acceptance", ""),  # a synthetic profile (engine.core.synthetic): the text is not model output
]
ROUND_COLUMNS = [
    ("drafted", "tokens"), ("verified", "tokens"), ("accepted", "tokens"), ("emitted", "tokens"),
    ("next_is_bonus", "bool"),
    ("draft_ms", "ms"), ("verify_ms", "ms"), ("overhead_ms", "ms"), ("round_ms", "ms"),
]
RUNNING_COLUMNS = [  # the generation's running aggregates after this round
    ("running_acceptance_rate", "ratio"), ("running_mean_acceptance_length", "tokens"),
    ("running_tokens_per_forward", "tokens"), ("running_analytic_tokens_per_forward", "tokens"),
    ("running_per_position_tokens_per_forward", "tokens"), ("running_tpot_ms", "ms"),
    ("running_tokens_per_s", "tokens/s"),
]
CSV_COLUMNS = ([("generation", ""), ("round", "")] + SETTINGS_COLUMNS + ROUND_COLUMNS + RUNNING_COLUMNS
               + [("finish_reason", "")])


def csv_header() -> list[str]:
    """Column names with their units, e.g. 'draft_ms [ms]'."""
    return [f"{name} [{unit}]" if unit else name for name, unit in CSV_COLUMNS]


def settings_values(header: dict) -> dict:
    """The settings columns of a trace header (engine.files.trace.make_header); empty cells for what it lacks.
    K is empty for plain decoding."""
    settings = header.get("settings") or {}
    sampling = settings.get("sampling") or {}
    models = header.get("models") or {}
    plain = settings.get("method") == "none"
    return {"method": header.get("spec") or settings.get("method", ""),
            "k": "" if plain else settings.get("k", ""), "temperature": sampling.get("temperature", ""),
            "top_k": sampling.get("top_k", ""), "top_p": sampling.get("top_p", ""),
            "seed": settings.get("seed", ""), "tree_nodes": settings.get("tree_nodes", ""),
            "target": models.get("target") or "", "draft": models.get("draft") or "",
            "device": header.get("device") or "", "dtype": header.get("dtype") or "",
            "synthetic_acceptance": header.get("synthetic_acceptance") or ""}


def csv_row(event: RoundEvent, generation: int = 0, header: dict | None = None,
            finish: str | None = None) -> list:
    """One round as CSV cells. `header` gives the settings columns (without it: the event's method and K);
    `finish` the run's end when the event does not carry one (a stopped or failed run's last round)."""
    m = event.metrics
    values = settings_values(header) if header else {
        "method": event.method, "k": "" if event.method == "none" else event.k}
    values.update({
        "synthetic_acceptance": event.synthetic_acceptance or values.get("synthetic_acceptance", ""),
        "generation": generation, "round": event.round + 1,
        "drafted": len(event.drafted), "verified": event.verified_tokens or len(event.drafted) + 1,
        "accepted": event.accepted_count, "emitted": len(event.emitted_ids),
        "next_is_bonus": int(event.next_is_bonus), "draft_ms": event.draft_ms, "verify_ms": event.verify_ms,
        "overhead_ms": event.overhead_ms, "round_ms": event.round_ms,
        "running_acceptance_rate": m.acceptance_rate if m.drafted else "",
        "running_mean_acceptance_length": m.mean_acceptance_length,
        "running_tokens_per_forward": m.tokens_per_forward,
        "running_analytic_tokens_per_forward": m.analytic_tokens_per_forward,
        "running_per_position_tokens_per_forward": m.per_position_tokens_per_forward,
        "running_tpot_ms": m.tpot_ms, "running_tokens_per_s": m.tokens_per_s,
        "finish_reason": event.finish_reason or finish or "",
    })
    for name in _unknown_columns(event):  # what a served engine did not give: empty, never 0
        values[name] = ""
    return [_fmt(values.get(name, "")) for name, _ in CSV_COLUMNS]


def _unknown_columns(event: RoundEvent) -> list:
    """The CSV columns a round's source did not give (RoundEvent.unknown)."""
    unknown = set(event.unknown)
    columns = ["verified"] if event.served else []
    if "phase_times" in unknown:
        columns += ["draft_ms", "verify_ms", "overhead_ms"]
    if "drafted" in unknown:
        columns += ["drafted", "accepted", "next_is_bonus", "running_acceptance_rate",
                    "running_mean_acceptance_length", "running_tokens_per_forward",
                    "running_analytic_tokens_per_forward", "running_per_position_tokens_per_forward"]
    return columns


def csv_rows(runs) -> Iterable[list]:
    """The CSV rows of runs (engine.files.trace.Run: header, events, finish), one per round."""
    for run in runs:
        last = len(run.events) - 1
        for index, event in enumerate(run.events):
            yield csv_row(event, run.generation, run.header, run.finish if index == last else None)


def _fmt(value):
    return f"{value:.6g}" if isinstance(value, float) else value


def _open_for_writing(path):
    try:
        return open(path, "w", newline="", encoding="utf-8")
    except OSError as exc:
        raise SpecplayError(f"cannot write {path}: {exc.strerror or exc}") from None


def _as_row(item) -> list:
    if isinstance(item, list):
        return item
    generation, event = item if isinstance(item, tuple) else (0, item)
    return csv_row(event, generation)


def write_csv(rows: Iterable, path) -> int:
    """The header line, then one line per row: rows from csv_rows(runs), or RoundEvents, or (generation,
    RoundEvent) pairs. Returns the row count."""
    count = 0
    with _open_for_writing(path) as handle:
        writer = csv.writer(handle)
        writer.writerow(csv_header())
        for item in rows:
            writer.writerow(_as_row(item))
            count += 1
    return count


def _as_record(item) -> dict:
    if isinstance(item, dict):
        return item
    generation, event = item if isinstance(item, tuple) else (0, item)
    return {"type": "round", "generation": generation, **event.to_dict()}


def write_jsonl(records: Iterable, path) -> int:
    """One JSON object a line: records from engine.files.trace.trace_records(runs) (headers and rounds), or
    RoundEvents, or (generation, RoundEvent) pairs. Returns the number of round records."""
    rounds = 0
    with _open_for_writing(path) as handle:
        for item in records:
            record = _as_record(item)
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            rounds += record.get("type", "round") == "round"
    return rounds
