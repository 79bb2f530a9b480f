"""The RoundEvent stream: one event per decoding round, read alike by the GUI, the CLI and the exporters."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class DraftedToken:
    """One drafted token and what verification decided about it."""

    token_id: int
    text: str
    parent: int  # index in the round's draft of the parent node, -1 = the last committed token
    depth: int  # 0 = first drafted position
    p: float  # target probability of the token (after temperature / top-k / top-p; T=1 softmax when greedy)
    q: float  # draft probability (1.0 for deterministic drafts)
    accept_prob: float  # min(1, p/q) (greedy: 1 if the token is the target's argmax else 0)
    u: Optional[float]  # the uniform it was tested against (None when greedy or never tested)
    accepted: bool
    tested: bool  # False when an earlier rejection ended the round before this token was reached
    top: list = field(default_factory=list)  # target's top alternatives at this position: [(text, prob)]


@dataclass
class RoundMetrics:
    """Running aggregates after this round."""

    rounds: int
    drafted: int
    accepted: int
    emitted: int
    acceptance_rate: float
    mean_acceptance_length: float
    tokens_per_forward: float
    tpot_ms: float
    tokens_per_s: float
    analytic_tokens_per_forward: float
    per_position_tokens_per_forward: float
    per_position_acceptance: list = field(default_factory=list)  # alpha_i: accepted / reached at depth i
    accepted_length_histogram: list = field(default_factory=list)  # rounds by accepted count 0, 1, 2, ...
    draft_ms: float = 0.0  # totals over the generation so far
    verify_ms: float = 0.0
    overhead_ms: float = 0.0

    @classmethod
    def empty(cls) -> "RoundMetrics":
        """The metrics of a generation that ran no round."""
        return cls(rounds=0, drafted=0, accepted=0, emitted=0, acceptance_rate=0.0,
                   mean_acceptance_length=0.0, tokens_per_forward=0.0, tpot_ms=0.0, tokens_per_s=0.0,
                   analytic_tokens_per_forward=0.0, per_position_tokens_per_forward=0.0)


@dataclass
class RoundEvent:
    round: int  # 0-based
    method: str
    k: int
    drafted: list  # [DraftedToken] in draft order (a chain or a tree in topological order)
    accepted_count: int  # drafted tokens accepted (the length of the accepted path)
    next_token_id: int  # correction (after a rejection) or bonus (all accepted) token from the target
    next_token_text: str
    next_is_bonus: bool  # True: every drafted token was accepted (or nothing was drafted)
    next_token_p: float
    next_top: list  # target's top alternatives at the next token's position: [(text, prob)]
    emitted_ids: list  # token ids this round appended to the output (accepted drafts + next token)
    emitted_text: str
    position: int  # index in the generated text of the first token this round emitted
    draft_ms: float
    verify_ms: float
    overhead_ms: float  # bookkeeping: acceptance, cache rollback, detokenisation
    finished: bool
    finish_reason: Optional[str]  # "eos" | "length" | "stopped" | None
    metrics: RoundMetrics
    # tokens in the round's verification forward: the last committed token and the drafts, except where a
    # round verifies a fixed block whatever it drafted (n-gram's replayed GPU round: all K slots, K + 1);
    # None (traces from before it): len(drafted) + 1
    verified_tokens: Optional[int] = None
    # a synthetic profile's spelling (engine.core.synthetic) when the verdict followed it and not the target:
    # the emitted text is then NOT model output; "" = real verification
    synthetic_acceptance: str = ""
    # a served engine's label (engine.sources: "llama.cpp http://host:port") when the round came from a
    # server; "" = the local engine
    served: str = ""
    # figures the source did not give (a server: "p", "q", "accept_prob", "u", "token_ids", "top",
    # "phase_times", and "drafted"/"accepted" where it streams no counters): those fields hold None (or -1
    # for ids) and views say "not given", never 0
    unknown: list = field(default_factory=list)

    @property
    def round_ms(self) -> float:
        return self.draft_ms + self.verify_ms + self.overhead_ms

    def to_dict(self) -> dict:
        """As dataclasses.asdict (which walks and deep-copies every value: 0.2 ms a round, at the end of each
        generation on the window's thread), field by field: the drafted tokens and metrics as dicts, their
        lists copied."""
        out = {name: _copy(value) for name, value in vars(self).items()}
        out["drafted"] = [{name: _copy(value) for name, value in vars(token).items()}
                          for token in self.drafted]
        out["metrics"] = {name: _copy(value) for name, value in vars(self.metrics).items()}
        return out


def _copy(value):
    """A list of plain values, or of pairs (the top alternatives), copied as asdict copies them."""
    if isinstance(value, list):
        return [type(item)(item) if isinstance(item, (tuple, list)) else item for item in value]
    return value
