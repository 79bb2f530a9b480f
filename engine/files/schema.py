"""The trace schema: what a header or round record (engine.files.trace) may hold. A trace is read back from
disk, so it is untrusted: every field is checked for its type, its range, finite numbers and sizes bounded by
what a real run can produce, before any of it is used (a drafted depth of 10⁹ would otherwise size the
prediction's tables). check_record raises FieldError naming the field; the reader adds the file and line.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import replace

from engine.config import MAX_K, MAX_NEW_TOKENS
from engine.errors import SpecplayError

FORMAT = "specplay-trace/1"
MAX_TRACE_BYTES = 256 << 20  # a 2^24-token run's trace is far smaller
MAX_DRAFTED = 1024  # drafted tokens in one round (trees hold at most MAX_TREE_NODES; chains MAX_K)
MAX_TOP = 64  # top alternatives listed at a position
MAX_TOKEN_ID = 2**31 - 1
MAX_TOKEN_TEXT = 1 << 16  # characters of one token's text
MAX_TEXT = 16 << 20  # characters of a prompt or a round's emitted text
MAX_NAME = 4096  # characters of a model name, device, dtype, version, spec
MAX_PROMPT_IDS = 1 << 24
MAX_GENERATION = 10**9
MAX_COUNT = 2**40  # a running count (rounds, tokens) over a generation
MAX_MS = 1e9  # any time in milliseconds (11 days)
MAX_RATE = 1e12  # tokens per second, tokens per forward and other running ratios
PROBABILITY_SLACK = 1e-3  # float32 softmax sums may pass 1 by a rounding error
FINISH_REASONS = ("eos", "length", "stopped", "error")
RECORD_TYPES = ("header", "round")


class FieldError(Exception):
    """A record field that does not fit the schema; `field` is its dotted path (drafted[3].depth)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


# ------------------------------------------------------------------------------------------------ values
def integer(value, field: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(field, f"must be an integer (got {_shown(value)})")
    if not low <= value <= high:
        raise FieldError(field, f"must be between {low} and {high} (got {value})")
    return value


def real(value, field: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FieldError(field, f"must be a number (got {_shown(value)})")
    if not math.isfinite(value):
        raise FieldError(field, f"must be a finite number (got {value})")
    if not low <= value <= high:
        raise FieldError(field, f"must be between {low:g} and {high:g} (got {value:g})")
    return value


def probability(value, field: str) -> float:
    return real(value, field, 0.0, 1.0 + PROBABILITY_SLACK)


def text(value, field: str, limit: int, optional: bool = False):
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise FieldError(field, f"must be text (got {_shown(value)})")
    if len(value) > limit:
        raise FieldError(field, f"is longer than {limit} characters")
    return value


def boolean(value, field: str) -> bool:
    if not isinstance(value, bool):
        raise FieldError(field, f"must be true or false (got {_shown(value)})")
    return value


def array(value, field: str, limit: int, optional: bool = False) -> list:
    if value is None and optional:
        return []
    if not isinstance(value, list):
        raise FieldError(field, f"must be a list (got {_shown(value)})")
    if len(value) > limit:
        raise FieldError(field, f"holds {len(value)} entries, more than {limit}")
    return value


def mapping(value, field: str, optional: bool = False) -> dict:
    if value is None and optional:
        return {}
    if not isinstance(value, dict):
        raise FieldError(field, f"must be an object (got {_shown(value)})")
    return value


def _shown(value) -> str:
    """A wrong value as the message shows it: its JSON type, and the value when it is short."""
    kind = {str: "text", list: "a list", dict: "an object", bool: "true/false", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)
    brief = repr(value)
    return f"{kind} {brief}" if len(brief) <= 40 and not isinstance(value, (list, dict)) else kind


# ------------------------------------------------------------------------------------------------ records
def check_record(record, metrics_required: bool = False) -> str:
    """The record's type ('header', 'round' or another a reader skips) once every field fits the schema;
    FieldError otherwise.
    metrics_required: the window replays rounds' running metrics (predict needs only the phase times)."""
    if not isinstance(record, dict):
        raise FieldError("record", "not a trace record (a JSON object)")
    kind = text(record.get("type", "round"), "type", MAX_NAME)
    if kind not in RECORD_TYPES:
        return kind  # a record a later version adds (a note): skipped by the readers
    if kind == "header":
        check_header(record)
    else:
        check_round(record, metrics_required)
    return kind


def check_header(record: dict) -> None:
    if "format" in record and record["format"] != FORMAT:
        raise FieldError("format", f"unknown format {_shown(record['format'])} (this reader knows {FORMAT})")
    integer(record.get("generation", 1), "generation", 1, MAX_GENERATION)
    text(record.get("prompt", ""), "prompt", MAX_TEXT)
    text(record.get("spec"), "spec", MAX_NAME, optional=True)
    for name in ("device", "dtype", "target", "draft"):
        text(record.get(name), name, MAX_NAME, optional=True)
    for name, value in mapping(record.get("models"), "models", optional=True).items():
        text(value, f"models.{name}", MAX_NAME, optional=True)
    for name, value in mapping(record.get("versions"), "versions", optional=True).items():
        text(value, f"versions.{name}", MAX_NAME, optional=True)
    if "prompt_ids" in record:
        for i, token in enumerate(array(record["prompt_ids"], "prompt_ids", MAX_PROMPT_IDS)):
            integer(token, f"prompt_ids[{i}]", 0, MAX_TOKEN_ID)
    check_settings(record.get("settings", record.get("config")))
    _check_calibration(record.get("calibration"))
    _check_suffix_memory(record.get("suffix_memory"))
    if "batch" in record:
        integer(record["batch"], "batch", 1, 1 << 16)


def check_settings(settings) -> None:
    """A header's settings must make a valid GenerationConfig (its suffix corpus file need not exist here)."""
    from engine.config import config_from_dict

    settings = mapping(settings, "settings", optional=True)
    if not settings:
        return
    sampling = mapping(settings.get("sampling"), "settings.sampling", optional=True)
    text(settings.get("suffix_corpus", ""), "settings.suffix_corpus", MAX_NAME)
    try:
        config = config_from_dict(dict(settings, sampling=sampling))
        replace(config, suffix_corpus="").validate()
    except (SpecplayError, TypeError, ValueError) as exc:
        raise FieldError("settings", str(exc)) from None


def _check_calibration(calibration) -> None:
    for name, value in mapping(calibration, "calibration", optional=True).items():
        real(value, f"calibration.{name}", 0.0, MAX_MS)


def _check_suffix_memory(fingerprint) -> None:
    fingerprint = mapping(fingerprint, "suffix_memory", optional=True)
    if not fingerprint:
        return
    integer(fingerprint.get("documents", 0), "suffix_memory.documents", 0, MAX_COUNT)
    integer(fingerprint.get("tokens", 0), "suffix_memory.tokens", 0, MAX_COUNT)
    integer(fingerprint.get("vocab", 1), "suffix_memory.vocab", 1, MAX_TOKEN_ID)
    text(fingerprint.get("sha256", ""), "suffix_memory.sha256", 64)


def check_round(record: dict, metrics_required: bool = False) -> None:
    from engine.methods.registry import NAMES

    if "generation" in record:
        integer(record["generation"], "generation", 0, MAX_GENERATION)
    method = text(_required(record, "method"), "method", MAX_NAME)
    if method not in NAMES:
        raise FieldError("method", f"unknown method {method!r} (known: {', '.join(NAMES)})")
    integer(record.get("round", 0), "round", 0, MAX_NEW_TOKENS)
    integer(_required(record, "k"), "k", 0, MAX_K)
    served = bool(text(record.get("served", ""), "served", MAX_TEXT))
    _check_unknown(record.get("unknown"), served)
    lowest_id = -1 if served else 0  # a server does not say its token ids: -1
    drafted = array(_required(record, "drafted"), "drafted", MAX_DRAFTED)
    _check_drafted(drafted, served)
    integer(_required(record, "accepted_count"), "accepted_count", 0, len(drafted))
    emitted_limit = MAX_DRAFTED + 1 if served else len(drafted) + 1  # a server's chunk may hold several
    emitted = array(record.get("emitted_ids", []), "emitted_ids", emitted_limit)
    for i, token in enumerate(emitted):
        integer(token, f"emitted_ids[{i}]", lowest_id, MAX_TOKEN_ID)
    if "next_token_id" in record:
        integer(record["next_token_id"], "next_token_id", lowest_id, MAX_TOKEN_ID)
    for name in ("next_token_text", "emitted_text"):
        text(record.get(name, ""), name, MAX_TEXT)
    text(record.get("synthetic_acceptance", ""), "synthetic_acceptance", MAX_NAME)
    for name in ("next_is_bonus", "finished"):
        if name in record:
            boolean(record[name], name)
    if not (served and record.get("next_token_p", 1.0) is None):
        probability(record.get("next_token_p", 1.0), "next_token_p")
    _check_top(record.get("next_top"), "next_top")
    integer(record.get("position", 0), "position", 0, MAX_NEW_TOKENS)
    for name in ("draft_ms", "verify_ms", "overhead_ms"):
        real(_required(record, name), name, 0.0, MAX_MS)
    if record.get("finish_reason") is not None and record["finish_reason"] not in FINISH_REASONS:
        raise FieldError("finish_reason", f"unknown finish {_shown(record['finish_reason'])} "
                                          f"({', '.join(FINISH_REASONS)} or null)")
    if record.get("verified_tokens") is not None:
        integer(record["verified_tokens"], "verified_tokens", 1, MAX_DRAFTED + MAX_K + 1)
    if metrics_required or "metrics" in record:
        check_metrics(_required(record, "metrics"))


def _required(record: dict, name: str):
    if name not in record:
        raise FieldError(name, "missing")
    return record[name]


def _check_unknown(unknown, served: bool) -> None:
    """The names of figures a served round's source did not give (only a served round has any)."""
    for i, name in enumerate(array(unknown, "unknown", 32, optional=True)):
        text(name, f"unknown[{i}]", MAX_NAME)
    if unknown and not served:
        raise FieldError("unknown", "only a served round (with 'served') may leave figures unknown")


def _check_drafted(drafted: list, served: bool = False) -> None:
    """Each drafted token: a tree in topological order (a parent comes first), its depth its parent's + 1.
    A served round's tokens may be unknown: id -1, probabilities None."""
    depths: list = []
    for i, token in enumerate(drafted):
        at = f"drafted[{i}]"
        token = mapping(token, at)
        integer(_required_in(token, "token_id", at), f"{at}.token_id", -1 if served else 0, MAX_TOKEN_ID)
        parent = integer(_required_in(token, "parent", at), f"{at}.parent", -1, i - 1)
        depth = integer(_required_in(token, "depth", at), f"{at}.depth", 0, MAX_DRAFTED)
        if depth != (0 if parent < 0 else depths[parent] + 1):
            raise FieldError(f"{at}.depth", f"is {depth}, but its parent's depth + 1 is "
                                            f"{0 if parent < 0 else depths[parent] + 1}")
        depths.append(depth)
        text(token.get("text", ""), f"{at}.text", MAX_TOKEN_TEXT)
        for name in ("p", "q", "accept_prob"):
            if not (served and token.get(name, 1.0) is None):
                probability(token.get(name, 1.0), f"{at}.{name}")
        if token.get("u") is not None:
            probability(token["u"], f"{at}.u")
        for name in ("accepted", "tested"):
            boolean(token.get(name, False), f"{at}.{name}")
        _check_top(token.get("top"), f"{at}.top")


def _required_in(token: dict, name: str, at: str):
    if name not in token:
        raise FieldError(f"{at}.{name}", "missing")
    return token[name]


def _check_top(top, field: str) -> None:
    for i, pair in enumerate(array(top, field, MAX_TOP, optional=True)):
        pair = array(pair, f"{field}[{i}]", 2)
        if len(pair) != 2:
            raise FieldError(f"{field}[{i}]", "must be a [text, probability] pair")
        text(pair[0], f"{field}[{i}][0]", MAX_TOKEN_TEXT)
        probability(pair[1], f"{field}[{i}][1]")


METRIC_COUNTS = ("rounds", "drafted", "accepted", "emitted")
METRIC_RATES = ("acceptance_rate", "mean_acceptance_length", "tokens_per_forward", "tokens_per_s",
                "analytic_tokens_per_forward", "per_position_tokens_per_forward")
METRIC_TIMES = ("tpot_ms", "draft_ms", "verify_ms", "overhead_ms")


def check_metrics(metrics) -> None:
    metrics = mapping(metrics, "metrics")
    for name in METRIC_COUNTS + METRIC_RATES:
        if name not in metrics:
            raise FieldError(f"metrics.{name}", "missing")
    for name in METRIC_COUNTS:
        integer(metrics[name], f"metrics.{name}", 0, MAX_COUNT)
    for name in METRIC_RATES:
        real(metrics[name], f"metrics.{name}", 0.0, MAX_RATE)
    for name in METRIC_TIMES:
        real(metrics.get(name, 0.0), f"metrics.{name}", 0.0, MAX_MS * 1000)
    for i, value in enumerate(array(metrics.get("per_position_acceptance"), "metrics.per_position_acceptance",
                                    MAX_DRAFTED, optional=True)):
        probability(value, f"metrics.per_position_acceptance[{i}]")
    for i, value in enumerate(array(metrics.get("accepted_length_histogram"),
                                    "metrics.accepted_length_histogram", MAX_DRAFTED + 1, optional=True)):
        integer(value, f"metrics.accepted_length_histogram[{i}]", 0, MAX_COUNT)
