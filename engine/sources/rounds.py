"""Streamed chunks of a served completion -> the RoundEvent stream the local engine emits.

What the server reveals becomes the round: the text, the arrival times and, where the engine streams its
running speculative counters (llama.cpp with timings_per_token), how many tokens a verification step
drafted and accepted. Those counters change once a verification step, and its accepted tokens + 1 then
arrive as chunks, so a change of the counters opens a round of accepted + 1 tokens. What the server does
not reveal is marked in RoundEvent.unknown and left None (p, q, min(1, p/q), u, token ids, the draft/verify
split of a round's time), never filled with zeros."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.core.metrics import MetricsAccumulator
from engine.events import DraftedToken, RoundEvent

UNKNOWN_ALWAYS = ("p", "q", "accept_prob", "u", "token_ids", "top", "phase_times")
UNKNOWN_DRAFTS = ("drafted", "accepted")  # a server that streams no speculative counters
UNKNOWN_ID = -1


@dataclass
class Chunk:
    """One streamed chunk: arrival time (ms since the request was sent), text, tokens it holds and the running
    draft counters streamed with it (None: not streamed)."""

    at_ms: float
    text: str
    tokens: int = 1
    draft_n: Optional[int] = None
    draft_accepted: Optional[int] = None
    finish: Optional[str] = None


class RoundBuilder:
    """Feed chunks in arrival order; rounds come out as they complete (finish() flushes the last)."""

    def __init__(self, method: str, k: int, served: str):
        self.method, self.k, self.served = method, k, served
        self.metrics = MetricsAccumulator(k)
        self.rounds: list = []
        self._open: list = []  # chunks of the round being filled
        self._open_drafted = 0
        self._open_accepted = 0
        self._expected = 1  # tokens the open round holds when complete
        self._last_counts = (0, 0)
        self._last_end_ms = 0.0
        self._position = 0
        self._counts_known = False

    def add(self, chunk: Chunk) -> list:
        """The rounds this chunk completed (zero or one, or two when it opens a new round after a
        completed one)."""
        if chunk.tokens == 0:  # a closing chunk (finish reason, figures): the open round's end
            if self._open:
                self._open.append(chunk)
            return []
        done = []
        counts = (chunk.draft_n, chunk.draft_accepted)
        if chunk.draft_n is not None:
            self._counts_known = True
        opens = counts != self._last_counts and chunk.draft_n is not None
        if self._open and (opens or self._tokens() >= self._expected):
            done.append(self._close(finish=None))
        if not self._open:
            self._start(counts if opens else None)
        if chunk.draft_n is not None:
            self._last_counts = counts
        self._open.append(chunk)
        return done

    def finish(self, reason: Optional[str]) -> list:
        return [self._close(finish=reason or "stopped")] if self._open else []

    def _start(self, counts) -> None:
        drafted = accepted = 0
        if counts is not None:
            drafted = counts[0] - self._last_counts[0]
            accepted = max(0, min(drafted, counts[1] - self._last_counts[1]))
        self._open_drafted, self._open_accepted = max(0, drafted), accepted
        self._expected = accepted + 1

    def _tokens(self) -> int:
        return sum(c.tokens for c in self._open)

    def _close(self, finish: Optional[str]) -> RoundEvent:
        chunks, self._open = self._open, []
        end_ms = chunks[-1].at_ms
        round_ms = max(0.0, end_ms - self._last_end_ms)
        self._last_end_ms = end_ms
        drafted, accepted = self._open_drafted, self._open_accepted
        emitted = sum(c.tokens for c in chunks)
        metrics = self.metrics.add_round(drafted, accepted, emitted, drafted, 0.0, round_ms, 0.0)
        text = "".join(c.text for c in chunks)
        event = RoundEvent(
            round=len(self.rounds), method=self.method, k=self.k,
            drafted=[_unknown_token(i, accepted) for i in range(drafted)], accepted_count=accepted,
            next_token_id=UNKNOWN_ID, next_token_text=chunks[-1].text, next_is_bonus=accepted == drafted,
            next_token_p=None, next_top=[], emitted_ids=[UNKNOWN_ID] * emitted, emitted_text=text,
            position=self._position, draft_ms=0.0, verify_ms=round_ms, overhead_ms=0.0,
            finished=finish is not None, finish_reason=finish, metrics=metrics, verified_tokens=None,
            served=self.served,
            unknown=list(UNKNOWN_ALWAYS + (() if self._counts_known else UNKNOWN_DRAFTS)))
        self._position += emitted
        self.rounds.append(event)
        return event


def _unknown_token(index: int, accepted: int) -> DraftedToken:
    """A drafted position the server counted but did not show: its token and probabilities unknown."""
    return DraftedToken(token_id=UNKNOWN_ID, text="", parent=index - 1, depth=index, p=None, q=None,
                        accept_prob=None, u=None, accepted=index < accepted, tested=index <= accepted)
