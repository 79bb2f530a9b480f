"""The serving engines' own speculative counters, read the way each publishes them.

- llama.cpp: per response `timings` (draft_n, draft_n_accepted, predicted_n, predicted_ms) and, with
  --metrics, Prometheus text: llamacpp:spec_decode_num_drafts_total, ..._num_draft_tokens_total,
  ..._num_accepted_tokens_total and llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="i"}.
- vLLM: Prometheus counters vllm:spec_decode_num_drafts, ..._num_draft_tokens, ..._num_accepted_tokens and
  vllm:spec_decode_num_accepted_tokens_per_pos{position="i"} (exported with a _total suffix), summed over
  their other labels; a request's share is the difference of scrapes taken before and after it.
- SGLang: per request meta_info spec_accept_length (tokens per forward) / spec_accept_rate.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

from engine.errors import SpecplayError


class MetricsFormatError(SpecplayError):
    """A metrics endpoint answered with text that is not Prometheus exposition format."""


@dataclass
class SpecCounters:
    """Speculative counts of one request (or a difference of two scrapes). None: the engine does not say."""

    drafts: Optional[int] = None  # verification steps that drafted
    draft_tokens: Optional[int] = None
    accepted: Optional[int] = None
    accepted_per_position: list = field(default_factory=list)  # accepted drafts at draft position i
    accept_length: Optional[float] = None  # SGLang: mean tokens a forward
    accept_rate: Optional[float] = None  # SGLang: its own rate

    @property
    def acceptance_rate(self) -> Optional[float]:
        """α = accepted / drafted tokens (None where the engine gives no counts)."""
        if self.draft_tokens and self.accepted is not None:
            return self.accepted / self.draft_tokens
        return self.accept_rate

    def per_position_acceptance(self) -> list:
        """α_i = accepted at position i / drafts that reached position i. The counters give how many drafts
        ran (drafts) and how many accepted a token at each position: a draft reaches position i when it
        accepted at every earlier one, so the drafts reaching i are the accepted count at i - 1."""
        if not self.accepted_per_position or not self.drafts:
            return []
        reached = [self.drafts] + list(self.accepted_per_position[:-1])
        return [a / r if r else 0.0 for a, r in zip(self.accepted_per_position, reached)]

    def minus(self, before: "SpecCounters") -> "SpecCounters":
        """The counts between two scrapes (this one after, `before` before)."""
        def diff(after, earlier):
            return None if after is None or earlier is None else after - earlier

        per_pos = [a - (before.accepted_per_position[i] if i < len(before.accepted_per_position) else 0)
                   for i, a in enumerate(self.accepted_per_position)]
        return SpecCounters(drafts=diff(self.drafts, before.drafts),
                            draft_tokens=diff(self.draft_tokens, before.draft_tokens),
                            accepted=diff(self.accepted, before.accepted), accepted_per_position=per_pos)


# ------------------------------------------------------------------------------------------------ Prometheus
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+-?\d+)?\s*$')
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def parse_prometheus(text: str) -> list:
    """[(name, {label: value}, value)] of Prometheus exposition text; MetricsFormatError on a line that is
    neither a comment nor a sample."""
    samples = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            raise MetricsFormatError(f"metrics line {number} is not Prometheus text: {line[:60]!r}")
        labels = _parse_labels(match.group(3) or "", number)
        try:
            value = float(match.group(4))
        except ValueError:
            raise MetricsFormatError(f"metrics line {number}: {match.group(4)[:20]!r} is not a number") \
                from None
        samples.append((match.group(1), labels, value))
    return samples


def _parse_labels(text: str, number: int) -> dict:
    labels, at = {}, 0
    while at < len(text):
        match = _LABEL.match(text, at)
        if not match:
            raise MetricsFormatError(f"metrics line {number}: malformed labels {text[:60]!r}")
        labels[match.group(1)] = match.group(2)
        at = match.end()
    return labels


def _sum(samples: list, *names: str) -> Optional[float]:
    """The sum of a counter over its labels (None when absent)."""
    values = [value for name, _, value in samples if name in names]
    return math.fsum(values) if values else None


def _per_position(samples: list, *names: str) -> list:
    by_position: dict = {}
    for name, labels, value in samples:
        if name in names and labels.get("position", "").isdigit():
            position = int(labels["position"])
            by_position[position] = by_position.get(position, 0.0) + value
    return [int(by_position.get(i, 0)) for i in range(max(by_position) + 1)] if by_position else []


def _count(value: Optional[float]) -> Optional[int]:
    return None if value is None else int(round(value))


def llamacpp_metrics(text: str) -> SpecCounters:
    """llama-server's /metrics (started with --metrics)."""
    samples = parse_prometheus(text)
    prefix = "llamacpp:spec_decode_"
    return SpecCounters(drafts=_count(_sum(samples, prefix + "num_drafts_total")),
                        draft_tokens=_count(_sum(samples, prefix + "num_draft_tokens_total")),
                        accepted=_count(_sum(samples, prefix + "num_accepted_tokens_total")),
                        accepted_per_position=_per_position(samples,
                                                            prefix + "num_accepted_tokens_per_pos_total"))


def vllm_metrics(text: str) -> SpecCounters:
    """vLLM's /metrics (v1 engine: counters, exported as NAME_total; the bare name read too)."""
    samples = parse_prometheus(text)

    def names(base: str) -> tuple:
        return ("vllm:" + base, "vllm:" + base + "_total")

    return SpecCounters(drafts=_count(_sum(samples, *names("spec_decode_num_drafts"))),
                        draft_tokens=_count(_sum(samples, *names("spec_decode_num_draft_tokens"))),
                        accepted=_count(_sum(samples, *names("spec_decode_num_accepted_tokens"))),
                        accepted_per_position=_per_position(
                            samples, *names("spec_decode_num_accepted_tokens_per_pos")))


# -------------------------------------------------------------------------------------------- per response
@dataclass
class Timings:
    """llama.cpp's `timings` object of a response (running counts when timings_per_token is on)."""

    predicted_n: Optional[int] = None
    predicted_ms: Optional[float] = None
    prompt_ms: Optional[float] = None
    draft_n: Optional[int] = None
    draft_n_accepted: Optional[int] = None


def llamacpp_timings(payload: dict) -> Optional[Timings]:
    """The `timings` of a llama.cpp response or stream chunk (None when it has none). draft_n is absent
    while nothing was drafted: that is 0 drafted, not unknown."""
    timings = payload.get("timings") if isinstance(payload, dict) else None
    if not isinstance(timings, dict):
        return None
    drafted = _int(timings.get("draft_n"))
    return Timings(predicted_n=_int(timings.get("predicted_n")),
                   predicted_ms=_num(timings.get("predicted_ms")),
                   prompt_ms=_num(timings.get("prompt_ms")), draft_n=drafted or 0,
                   draft_n_accepted=_int(timings.get("draft_n_accepted")) or 0)


def sglang_counters(payload: dict) -> Optional[SpecCounters]:
    """SGLang's meta_info spec_accept_length / spec_accept_rate (native /generate, or a completions response
    that carries meta_info); None when it has neither."""
    meta = payload.get("meta_info") if isinstance(payload, dict) else None
    if not isinstance(meta, dict):
        return None
    length, rate = _num(meta.get("spec_accept_length")), _num(meta.get("spec_accept_rate"))
    if length is None and rate is None:
        return None
    verify = _int(meta.get("spec_verify_ct"))
    return SpecCounters(drafts=verify, accept_length=length, accept_rate=rate)


def _int(value) -> Optional[int]:
    number = _num(value)
    return None if number is None else int(number)


def _num(value) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) else None
