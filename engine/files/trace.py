"""Saved runs: the trace format (JSON Lines) and its reader.

A trace is one header record per generation, each followed by that generation's rounds:

    {"type": "header", "format": "specplay-trace/1", "generation": 1, "prompt": ..., "settings": {...},
     "spec": "eagle:8", "models": {"target": ..., "draft": ...}, "device": ..., "dtype": ...,
     "versions": {"specplay": ..., "torch": ..., "transformers": ...}, "prompt_ids": [...]}
    {"type": "round", "generation": 1, **RoundEvent.to_dict()}

`settings` is GenerationConfig.to_dict(); `prompt_ids` (the prompt's token ids) is there where the writer knew
them (engine.analysis.predict replays n-gram lookup exactly from them). The last round of a generation
carries how it
ended in `finish_reason` ("eos", "length", "stopped", "error"). `read_trace` gives back a `Run` per generation
with RoundEvents rebuilt, so the window and the CLI replay a trace as if it ran live. Older traces (rounds
only, no header) read too, with an empty header.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field, fields
from importlib import metadata
from typing import Iterator, Optional

from engine.config import GenerationConfig, config_from_dict
from engine.errors import SpecplayError
from engine.events import DraftedToken, RoundEvent, RoundMetrics
from engine.files import bounded, schema
from engine.files.schema import FORMAT


@dataclass
class Run:
    """One generation: its header record, its rounds and how it ended."""

    header: dict
    events: list = field(default_factory=list)
    finish: Optional[str] = None  # "eos" | "length" | "stopped" | "error" | None (unknown)

    @property
    def generation(self) -> int:
        return int(self.header.get("generation", 1))

    @property
    def prompt(self) -> str:
        return str(self.header.get("prompt", ""))

    @property
    def config(self) -> GenerationConfig:
        return config_from_dict(self.header.get("settings") or {}, self.events)

    @property
    def models(self) -> dict:
        return dict(self.header.get("models") or {})


@functools.lru_cache(maxsize=1)
def _installed_versions() -> tuple:
    """(name, version) of specplay, torch and transformers, looked up once: the metadata scan costs
    milliseconds, and every header (the end of every generation in the window) asks."""
    found = []
    for name in ("specplay", "torch", "transformers"):
        try:
            found.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            found.append((name, None))
    return tuple(found)


def versions() -> dict:
    """Versions of specplay, torch and transformers (None when one is not installed)."""
    return dict(_installed_versions())


def make_header(prompt: str, config: GenerationConfig, target=None, draft=None, device=None, dtype=None,
                generation: int = 1, prompt_ids: Optional[list] = None) -> dict:
    """The header record of one generation. prompt_ids: the prompt's token ids, where known
    (engine.analysis.predict
    replays n-gram lookup exactly from them)."""
    header = {"type": "header", "format": FORMAT, "generation": generation, "prompt": prompt,
              "settings": config.to_dict(), "spec": config.spec,
              "models": {"target": _text(target), "draft": _text(draft)},
              "device": _text(device), "dtype": _text(dtype), "versions": versions()}
    if prompt_ids:
        header["prompt_ids"] = [int(i) for i in prompt_ids]
    if config.synthetic and config.drafts:  # the verdicts followed a profile: the text is not the model's
        from engine.core.synthetic import NOTE

        header["synthetic_acceptance"] = config.synthetic_acceptance
        header["note"] = NOTE
    return header


def _text(value) -> Optional[str]:
    return None if value is None else str(value)


def trace_records(runs) -> Iterator[dict]:
    """The records of a trace, run by run: each run's header, then its rounds."""
    for run in runs:
        header = dict(run.header, type="header", format=FORMAT)
        yield header
        for index, event in enumerate(run.events):
            yield round_record(event, run.generation, run.finish if index == len(run.events) - 1 else None)


def round_record(event: RoundEvent, generation: int, finish: Optional[str] = None) -> dict:
    record = {"type": "round", "generation": generation, **event.to_dict()}
    if finish and not record.get("finish_reason"):
        record["finish_reason"] = finish
    return record


# ------------------------------------------------------------------------------------------------ reading
def read_trace(path) -> list:
    """The runs of a saved trace, in file order. Raises SpecplayError, naming the line and the field, for a
    file that is not a valid trace (engine.files.schema), and refuses special or oversized files unread."""
    return parse_trace(read_lines(path), str(path))


def read_lines(path) -> list:
    """The lines of a trace file, read with the trace size limit (engine.files.bounded)."""
    return bounded.read_text(path, "trace", schema.MAX_TRACE_BYTES).splitlines()


def records(lines, name: str = "trace", metrics_required: bool = True) -> Iterator[tuple]:
    """(line number, record type, record) of each non-blank line, every record checked against the schema:
    the first that fails raises one SpecplayError naming the line and the field."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = _load(line, name, number)
        try:
            kind = schema.check_record(record, metrics_required)
        except schema.FieldError as exc:
            raise SpecplayError(f"{name}, line {number}, field {exc.field}: {exc.message}") from None
        yield number, kind, record


def parse_trace(lines, name: str = "trace") -> list:
    runs: list = []
    by_generation: dict = {}
    for number, kind, record in records(lines, name):
        if kind == "header":
            run = Run(header=record)
            runs.append(run)
            by_generation[run.generation] = run
        elif kind == "round":
            run = _run_for(record, runs, by_generation)
            run.events.append(_event(record, name, number))
            run.finish = run.events[-1].finish_reason or record.get("finish_reason")
    runs = [run for run in runs if run.events]
    if not runs:
        raise SpecplayError(f"{name} has no rounds: not a specplay trace")
    return runs


def _load(line: str, name: str, number: int) -> dict:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise SpecplayError(f"{name}, line {number}: not JSON ({exc.msg})") from None
    except (ValueError, RecursionError) as exc:  # an integer of 10^5 digits, nesting 10^5 deep
        raise SpecplayError(f"{name}, line {number}: not a trace record ({type(exc).__name__})") from None


def _run_for(record: dict, runs: list, by_generation: dict) -> Run:
    generation = int(record.get("generation", 0) or 0)
    run = by_generation.get(generation)
    if run is None:  # a headerless (older) trace
        run = Run(header={"generation": generation or 1})
        runs.append(run)
        by_generation[generation] = run
    return run


def _event(record: dict, name: str, number: int) -> RoundEvent:
    try:
        return event_from_dict(record)
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecplayError(f"{name}, line {number}: not a round record ({exc})") from None


def _pairs(values) -> list:
    return [tuple(v) for v in values or []]


def _known(cls, data: dict) -> dict:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def event_from_dict(data: dict) -> RoundEvent:
    """A RoundEvent from RoundEvent.to_dict() (extra keys ignored; finish "stopped"/"error" kept)."""
    values = _known(RoundEvent, data)
    values["drafted"] = [DraftedToken(**dict(_known(DraftedToken, d), top=_pairs(d.get("top"))))
                         for d in data["drafted"]]
    values["metrics"] = RoundMetrics(**_known(RoundMetrics, data["metrics"]))
    values["next_top"] = _pairs(data.get("next_top"))
    return RoundEvent(**values)


def other_models(recorded: dict, target: Optional[str], draft: Optional[str],
                 uses_draft: bool) -> Optional[str]:
    """Why a trace's recorded models (its header's "models") are not the ones --target/--draft name (None:
    the shipped pair), or None when they are the same or unknown: another machine's or model's rounds are then
    predicted from their own phase times, not from the loaded models' calibration."""
    wanted = {"target": target or "shipped", "draft": draft or ("shipped" if target is None else None)}
    for role in ("target", "draft") if uses_draft else ("target",):
        name = recorded.get(role)
        if name and wanted[role] and not _same_model(str(name), wanted[role]):
            return f"the trace was recorded with {role} {name}, not {wanted[role]}"
    return None


def _same_model(a: str, b: str) -> bool:
    """Model names compared: a local folder by its real path, a Hub id or 'shipped' as it is."""
    def key(name: str) -> str:
        return os.path.realpath(name) if os.path.isdir(name) else name

    return key(a) == key(b)
