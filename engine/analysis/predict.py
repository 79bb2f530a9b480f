"""Counterfactual K: from one recorded run, predict tokens per forward, speedup and the best K for other K.

Exact part. With greedy decoding and the draft model, the output G is the target's greedy text whatever K is
(speculation is lossless), and the draft model's next token after a context is a function of that context
alone. A round starting at position p drafted d_1..d_K and had a accepted, so d_{j+1} is the draft's next
token after G[:p+j] for every j <= a (and j < K): the trace knows the draft's next token at every position
but the bonus positions of fully accepted rounds. A K' round from p accepts the run of positions from p
where the draft's next token equals G's, so wherever those positions are known the K' round is determined
exactly.

Model part. Unknown positions (and every other drafter, and sampling) use the fitted per-depth alpha_d: an
unknown position at depth d agrees with probability alpha_d, and the expected number of rounds over the
output is a backward recursion over positions. The cost model (engine.analysis.costmodel) turns rounds into
time.
"""
from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Optional, Sequence

from engine.analysis.acceptance import DepthAcceptance, RoundShape
from engine.analysis.costmodel import CostModel, Measured, RoundTiming, timing_of
from engine.errors import SpecplayError

EXACT_METHODS = ("draft",)  # greedy drafters whose next token depends only on the context (see the docstring)
# n-gram lookup is a pure function of the context too, but its later proposals are not the tail of its first
# one; it is replayed exactly when the trace's header carries the prompt's token ids ("prompt_ids"). Suffix
# decoding also reads the session's memory: a K sweep, which knows it, hands the trace a replay.


# ------------------------------------------------------------------------------------------------ traces
@dataclass
class TraceRound:
    method: str
    k: int
    drafted: list  # token ids in draft order
    depths: list  # depth of each drafted token
    parents: list
    accepted: int
    emitted: list
    timing: RoundTiming
    sampled: bool  # a tested token carried a uniform (T > 0)
    greedy_violation: bool  # greedy, yet an accepted token or the next token was not the target's top choice
    finish_reason: Optional[str] = None

    @property
    def depth(self) -> int:
        return 1 + max(self.depths, default=-1)

    @functools.cached_property
    def is_tree(self) -> bool:  # asked for every K of a prediction: counted once
        return any(parent != i - 1 for i, parent in enumerate(self.parents))

    @property
    def shape(self) -> RoundShape:
        """A draft shallower than K whose every depth was accepted reached its next depth and failed there:
        the drafter proposed nothing more (a short match, an n-gram miss). Counted so, the per-depth model
        gives the run's own tokens per forward back, as RoundMetrics' per-position figures do."""
        depth = self.depth + 1 if self.accepted == self.depth < self.k else self.depth
        return RoundShape(depth, self.accepted)


@dataclass
class Trace:
    generations: list  # [[TraceRound]]
    # a generation's header (engine.files.trace.make_header); {} if none
    header: dict = field(default_factory=dict)
    headers: list = field(default_factory=list)  # each generation's own header where a file had several
    # K -> (drafted, accepted) of each round a greedy lookup drafter runs, where the one who recorded the run
    # can replay it (engine.bench.suite: suffix decoding, whose drafts also read the session's memory)
    replay: Optional[Callable[[int], list]] = None
    replayed: dict = field(default_factory=dict, repr=False)  # K -> replayed_rounds' answer, counted once

    @property
    def settings(self) -> dict:
        """The run's GenerationConfig as its header records it ("settings"; "config" in older traces)."""
        return self.header.get("settings") or self.header.get("config") or {}

    @property
    def rounds(self) -> list:
        return [r for gen in self.generations for r in gen]

    @property
    def method(self) -> str:
        return self.rounds[0].method if self.rounds else "none"

    @property
    def k(self) -> int:
        return max((r.k for r in self.rounds), default=0)

    @property
    def greedy(self) -> bool:
        temperature = (self.settings.get("sampling") or {}).get("temperature")
        if temperature is not None:
            return float(temperature) == 0.0
        return not any(r.sampled for r in self.rounds)

    @property
    def sampling(self):
        """The run's SamplingParams as its header records them; greedy, or T = 1 for a sampled run that
        records none."""
        from engine.config import SamplingParams

        recorded = self.settings.get("sampling") or {}
        known = {name: recorded[name] for name in ("temperature", "top_k", "top_p") if name in recorded}
        if not known:
            return SamplingParams() if self.greedy else SamplingParams(temperature=1.0)
        try:
            return SamplingParams(**known)
        except TypeError:
            return SamplingParams()

    @property
    def is_tree(self) -> bool:
        return any(r.is_tree for r in self.rounds)

    @property
    def prompt_ids(self) -> Optional[list]:
        """Each generation's prompt token ids (its header's "prompt_ids"), or None where one lacks them."""
        headers = self.headers or [self.header]
        if len(headers) != len(self.generations):
            return None
        ids = [h.get("prompt_ids") for h in headers]
        if not all(isinstance(i, list) and i and all(type(t) is int for t in i) for i in ids):
            return None  # missing, or not token ids (a hand-edited file): no exact replay
        return [list(i) for i in ids]

    @property
    def on_cpu(self) -> bool:
        """Whether the run's header says it ran on the CPU."""
        return "cpu" in str(self.header.get("device") or "").lower()

    @property
    def ngram_n(self) -> int:
        return int(self.settings.get("ngram_n", 3))  # 3: traces from before the setting was recorded

    @property
    def uses_ngram_table(self) -> bool:
        """Whether the run's n-gram drafter filled its proposals from the target's corpus table (a trace
        from before the table records no such setting, and had none)."""
        settings = self.settings
        if "ngram_corpus" not in settings:
            return False
        used = settings["ngram_corpus"]  # None: on the GPU only
        return bool(used) if used is not None else "cpu" not in str(self.header.get("device", "cpu")).lower()

    def ngram_table(self):
        """The target's corpus table where the run used one (None otherwise, or where it cannot be read
        here: the shipped target's, or a target directory's)."""
        if not self.uses_ngram_table:
            return None
        from engine.methods.ngram import corpus_table
        from engine.models.loading import shipped_pair

        target = self.header.get("target") or (self.header.get("models") or {}).get("target") or "shipped"
        return corpus_table.load(shipped_pair()[0] if target == "shipped" else target)

    @property
    def emitted(self) -> int:
        return sum(len(r.emitted) for r in self.rounds)

    @property
    def batch(self) -> int:
        return int(self.header.get("batch", self.settings.get("batch", 1)) or 1)

    def acceptance(self) -> DepthAcceptance:
        """Per-depth acceptance for the predictions: a draft that stopped short counts as a failure there."""
        return DepthAcceptance.from_rounds(r.shape for r in self.rounds if r.method != "none")

    def drafted_acceptance(self) -> DepthAcceptance:
        """Per-depth acceptance of the drafted tokens alone (a round that drafted nothing is left out), as
        the product's α is: how often the drafter agreed with the target where it proposed something."""
        return DepthAcceptance.from_rounds(RoundShape(r.depth, r.accepted) for r in self.rounds
                                           if r.method != "none")

    def timings(self) -> list:
        return [r.timing for r in self.rounds]


def _get(obj, name, default=None):
    return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)


def trace_round(event) -> TraceRound:
    """A TraceRound from a RoundEvent or from its JSON record."""
    drafted = _get(event, "drafted", [])
    ids = [_get(d, "token_id") for d in drafted]
    sampled = any(_get(d, "u") is not None for d in drafted)
    return TraceRound(method=_get(event, "method"), k=_get(event, "k"), drafted=ids,
                      depths=[_get(d, "depth") for d in drafted],
                      parents=[_get(d, "parent") for d in drafted],
                      accepted=_get(event, "accepted_count"), emitted=list(_get(event, "emitted_ids", [])),
                      timing=timing_of(event), sampled=sampled,
                      greedy_violation=not sampled and _violates_greedy(event, drafted),
                      finish_reason=_get(event, "finish_reason"))


def _violates_greedy(event, drafted) -> bool:
    """Greedy output must be the target's argmax at every position: an accepted draft whose p is below the
    target's top probability there, or a next token that is not its top choice, means the output changed."""
    for d in drafted:
        top = _get(d, "top", [])
        if _get(d, "accepted") and top and _get(d, "p") < _top_prob(top) - 1e-6:
            return True
    next_top = _get(event, "next_top", [])
    return bool(next_top) and _get(event, "next_token_p", 1.0) < _top_prob(next_top) - 1e-6


def _top_prob(top) -> float:
    return max(float(entry[1]) for entry in top)


def trace_from_events(events: Iterable) -> Trace:
    """A Trace from RoundEvents, or (generation, RoundEvent) pairs (several generations)."""
    generations: dict = {}
    current = -1
    for item in events:
        generation, event = item if isinstance(item, tuple) else (None, item)
        if generation is None:
            current += int(_get(event, "round", 0) == 0 or current < 0)
            generation = current
        generations.setdefault(generation, []).append(trace_round(event))
    return Trace([generations[g] for g in sorted(generations)])


def load_trace(path) -> Trace:
    """Read `main.py run --trace` JSONL through the trace reader (engine.files.trace.records: bounded, every
    record checked against the schema): a {"type": "header"} record is kept as the header, records without a
    type are rounds. Raises SpecplayError naming the line and field of the first record that does not fit."""
    from engine.files.trace import read_lines, records

    header, headers, rounds = {}, {}, []
    for _, kind, record in records(read_lines(path), str(path), metrics_required=False):
        if kind == "header":
            header = record
            headers[record.get("generation", 1)] = record
        elif kind == "round":
            rounds.append((record["generation"], record) if "generation" in record else record)
    if not rounds:
        raise SpecplayError(f"{path} holds no rounds")
    trace = trace_from_events(rounds)
    trace.header = header
    if len(headers) > 1 and all(isinstance(record, tuple) for record in rounds):  # several generations
        trace.headers = [headers.get(number, {}) for number in sorted({record[0] for record in rounds})]
    trace.replay = suffix_replay_from_headers(trace)
    return trace


def suffix_replay_from_headers(trace: Trace) -> Optional[Callable[[int], list]]:
    """Trace.replay for a saved greedy suffix-decoding trace whose headers fingerprint what the session's
    memory held as each generation began (engine.methods.suffix.drafter.memory_fingerprint): each generation's
    memory rebuilt from the trace's earlier generations, or None where any one's cannot be (a corpus file in
    the memory, generations the file lacks, headers without the fingerprint)."""
    from engine.config import config_from_dict
    from engine.methods.registry import node_budget
    from engine.methods.suffix.drafter import generations_replay, memory_from_generations

    if not trace.rounds or any(r.method != "suffix" for r in trace.rounds) or not trace.greedy:
        return None
    headers, prompts = trace.headers or [trace.header], trace.prompt_ids
    if prompts is None or len(headers) != len(trace.generations):
        return None
    generations, earlier = [], []
    for header, prompt_ids, rounds in zip(headers, prompts, trace.generations):
        output = [t for r in rounds for t in r.emitted]
        documents = memory_from_generations(earlier, header.get("suffix_memory"))
        if documents is None:
            return None
        generations.append((documents, prompt_ids, output))
        earlier.append((prompt_ids, output))
    try:
        config = config_from_dict(trace.settings)
    except (TypeError, ValueError, SpecplayError):
        return None
    return generations_replay(generations, node_budget(config), headers[-1]["suffix_memory"]["vocab"])


# -------------------------------------------------------------------------------------------- the exact part
class DraftOracle:
    """What one greedy generation's trace says about the draft at each output position."""

    def __init__(self, rounds: Sequence[TraceRound]):
        self.output = [t for r in rounds for t in r.emitted]
        self.next_draft: dict = {}  # position -> the draft's next token after output[:position]
        position = 0
        for r in rounds:
            known = min(r.accepted, len(r.drafted) - 1) + 1 if r.drafted else 0  # offsets 0..a (j < K)
            for j in range(known):
                self.next_draft[position + j] = r.drafted[j]
            position += len(r.emitted)

    def agrees(self, position: int) -> Optional[bool]:
        """Does the draft's next token at `position` equal the output's? None when the trace does not say."""
        token = self.next_draft.get(position)
        return None if token is None else token == self.output[position]

    def exact_accepted(self, position: int, k: int) -> Optional[int]:
        """The accepted count of a K round starting at `position`, or None when the trace does not say.
        A round that reaches the end of the output is determined (the output ends there)."""
        n = len(self.output)
        for i in range(k):
            if position + i >= n - 1:
                return i
            agree = self.agrees(position + i)
            if agree is None:
                return None
            if not agree:
                return i
        return k


def _accepted_distribution(oracle: DraftOracle, position: int, k: int, alphas: list) -> dict:
    """P(accepted = a) for a K round from `position`: known positions decide, unknown ones agree with
    probability alpha_d."""
    out: dict = {}
    alive = 1.0
    n = len(oracle.output)
    for i in range(k):
        if position + i >= n - 1:
            out[i] = out.get(i, 0.0) + alive
            return out
        agree = oracle.agrees(position + i)
        p_agree = alphas[i] if agree is None else float(agree)
        out[i] = out.get(i, 0.0) + alive * (1 - p_agree)
        alive *= p_agree
        if alive == 0.0:
            return out
    out[k] = out.get(k, 0.0) + alive
    return out


def expected_rounds(oracle: DraftOracle, k: int, alphas: list) -> float:
    """Expected rounds to emit the whole output with K: R(p) = 1 + sum_a P(a) R(p + a + 1), R(p >= n) = 0."""
    n = len(oracle.output)
    rounds = [0.0] * (n + k + 2)
    for position in range(n - 1, -1, -1):
        dist = _accepted_distribution(oracle, position, k, alphas)
        rounds[position] = 1.0 + sum(p * rounds[min(position + a + 1, n)] for a, p in dist.items())
    return rounds[0]


def determined_share(oracle: DraftOracle, k: int) -> float:
    """Share of the K path's rounds the trace determines, walking the path until its first undetermined
    round (after that the path itself is a guess)."""
    position, determined, n = 0, 0, len(oracle.output)
    while position < n:
        accepted = oracle.exact_accepted(position, k)
        if accepted is None:
            break
        determined += 1
        position += accepted + 1
    return 1.0 if position >= n else determined / max(1, determined + 1)


# ------------------------------------------------------------------------------------------------ predictions
@dataclass(frozen=True)
class KPrediction:
    k: int
    tokens_per_forward: float
    basis: str  # "exact", "exact + model (93 % ...)", "per-depth model", "per-depth model, extrapolated"
    uniform_tokens_per_forward: float  # the chapter's (1 - alpha^(K+1)) / (1 - alpha) at the pooled alpha
    round_ms: float
    tpot_ms: float
    speedup: float
    textbook_speedup: float  # E_uniform / (1 + cK), c measured

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def exact_applies(trace: Trace) -> bool:
    if trace.replay is not None:
        return trace.greedy
    if not trace.greedy or trace.is_tree:
        return False
    if trace.method == "ngram":  # replayed: it needs the prompt, and the table where the run used one
        table_ok = not trace.uses_ngram_table or trace.ngram_table() is not None
        return trace.prompt_ids is not None and table_ok
    return trace.method in EXACT_METHODS


def replayed_rounds(trace: Trace, k: int) -> Optional[list]:
    """(drafted, accepted) of each round a lookup drafter runs with K, replayed exactly (exact_applies); None
    for the drafters that are not replayed."""
    if not exact_applies(trace):
        return None
    if k not in trace.replayed:  # the count and the timing of a K both ask
        if trace.replay is not None:
            trace.replayed[k] = trace.replay(k)
        else:
            trace.replayed[k] = ngram_trace_replay(trace, k) if trace.method == "ngram" else None
    return trace.replayed[k]


def ngram_trace_replay(trace: Trace, k: int) -> list:
    """ngram_replay of each generation of the trace from its own prompt: (proposed, accepted) a round."""
    table, rounds = trace.ngram_table(), []
    for prompt_ids, generation in zip(trace.prompt_ids, trace.generations):
        output = [t for r in generation for t in r.emitted]
        rounds += ngram_replay(prompt_ids, output, k, trace.ngram_n, table)
    return rounds


def ngram_replay(prompt_ids: list, output: list, k: int, n: int, table=None) -> list:
    """(proposed, accepted) tokens of each round the n-gram drafter runs for `output` with K: replayed, since
    its proposal after a context is lookup_continuation(context) and greedy verification accepts its prefix
    that matches the output. table: the CorpusTable the run's drafter filled its proposals from, or None."""
    from engine.methods.ngram.drafter import lookup_continuation

    position, rounds = 0, []
    while position < len(output):
        proposal = lookup_continuation(list(prompt_ids) + output[:position], n, k, table)
        accepted = 0
        while accepted < len(proposal) and position + accepted < len(output) \
                and proposal[accepted] == output[position + accepted]:
            accepted += 1
        position += accepted + 1
        rounds.append((len(proposal), accepted))
    return rounds


def predict_tokens_per_forward(trace: Trace, k: int, acceptance: Optional[DepthAcceptance] = None) -> tuple:
    """(tokens per forward, basis) for K from the trace; acceptance: trace.acceptance() if counted."""
    acceptance = acceptance or trace.acceptance()
    if not exact_applies(trace):
        extrapolated = k > acceptance.extrapolated_from()
        lengths = [sum(len(r.emitted) for r in gen) for gen in trace.generations]
        rounds = sum(acceptance.expected_rounds(n, k, gen[-1].finish_reason in ("length", "eos"))
                     for n, gen in zip(lengths, trace.generations))
        basis = "per-depth model" + (", extrapolated" if extrapolated else "")
        return (sum(lengths) / rounds if rounds else 1.0), basis
    rounds = replayed_rounds(trace, k)
    if rounds is not None:
        return trace.emitted / max(1, len(rounds)), "exact (replayed)"
    alphas = acceptance.alphas_for(k)
    rounds, tokens, shares = 0.0, 0, []
    for generation in trace.generations:
        oracle = DraftOracle(generation)
        rounds += expected_rounds(oracle, k, alphas)
        tokens += len(oracle.output)
        shares.append(determined_share(oracle, k))
    share = min(shares) if shares else 0.0
    basis = "exact" if share >= 1.0 else f"exact + model ({100 * share:.0f} % of the path determined)"
    return (tokens / rounds if rounds else 1.0), basis


def predict_ks(trace: Trace, ks: Sequence[int], costs: CostModel) -> list:
    """A KPrediction per K; `costs` should already be refitted on the trace (see predict_from_trace)."""
    method = trace.method
    acceptance = trace.acceptance()
    c = costs.c(method)
    out = []
    for k in ks:
        expected, basis = predict_tokens_per_forward(trace, k, acceptance)
        uniform = acceptance.uniform_expected(k)
        round_ms = _round_ms(trace, k, costs)
        tpot = round_ms / max(expected, 1e-9)
        out.append(KPrediction(k=k, tokens_per_forward=expected, basis=basis,
                               uniform_tokens_per_forward=uniform,
                               round_ms=round_ms, tpot_ms=tpot,
                               speedup=costs.t_plain / tpot if tpot > 0 else 0.0,
                               textbook_speedup=uniform / (1 + c * k)))
    return out


def _round_ms(trace: Trace, k: int, costs: CostModel) -> float:
    """A round's predicted time for K. On the CPU a round verifies only what it drafted (a lookup drafter's
    short match or miss is a short block), so rounds are timed block by block: a replayed drafter's as
    replayed, the others' as the run drafted them, scaled by K / the run's K. On a GPU a round has its K + 1
    rows (a tree its nodes) whatever it drafts."""
    if not trace.on_cpu:
        return costs.t_round(trace.method, k, _block_size(trace, k))
    replayed = replayed_rounds(trace, k)
    if replayed is not None:
        drafted = [proposed for proposed, _ in replayed]
    else:
        scale = k / max(1, trace.k)
        drafted = [round(len(r.drafted) * scale) for r in trace.rounds]
    return statistics.fmean(costs.t_round(trace.method, k, n + 1) for n in drafted or [k])


def _block_size(trace: Trace, k: int) -> int:
    """Verified tokens for K: K + 1 for a chain; for a tree the run's nodes scaled by K / the run's K."""
    if not trace.is_tree:
        return k + 1
    nodes = sorted(len(r.drafted) for r in trace.rounds if r.drafted)
    typical = nodes[len(nodes) // 2] if nodes else k
    return 1 + max(1, round(typical * k / max(1, trace.k)))


def best_k(predictions: Sequence[KPrediction]) -> KPrediction:
    return max(predictions, key=lambda p: p.speedup)


@dataclass
class PredictionReport:
    trace: Trace
    costs: CostModel
    predictions: list
    acceptance: DepthAcceptance

    @property
    def best(self) -> KPrediction:
        return best_k(self.predictions)

    def to_dict(self) -> dict:
        a = self.acceptance
        return {"method": self.trace.method, "k": self.trace.k, "greedy": self.trace.greedy,
                "exact": exact_applies(self.trace), "costs": self.costs.to_dict(),
                "alphas": a.alphas, "alpha_intervals": a.intervals(), "pooled_alpha": a.pooled_alpha,
                "best_k": self.best.k, "predictions": [p.to_dict() for p in self.predictions]}


def predict_from_trace(trace: Trace, ks: Sequence[int], costs: Optional[CostModel] = None,
                       plain: Sequence = ()) -> PredictionReport:
    """Refit the cost model on the trace's phase times, then predict every K. plain: RoundTimings of plain
    rounds timed beside the traced run, which then give TPOT_plain (nothing else: the curve's level stays the
    traced run's)."""
    from engine.analysis.costmodel import from_trace

    refitted = costs.refit(trace.timings()) if costs is not None else from_trace(trace.timings())
    if plain:
        refitted = replace(refitted, plain=Measured.mean_of([r.draft_ms + r.verify_ms + r.overhead_ms
                                                             for r in plain]))
    return PredictionReport(trace, refitted, predict_ks(trace, ks, refitted), trace.acceptance())


def format_report(report: PredictionReport) -> str:
    t, a = report.trace, report.acceptance
    lines = [f"trace: method={t.method} K={t.k} rounds={len(t.rounds)} tokens={t.emitted} "
             f"{'greedy' if t.greedy else 'sampled'}{' tree' if t.is_tree else ''}",
             f"costs: {report.costs.describe(t.method)}",
             "alpha_d (95% CI): " + ", ".join(f"{x:.2f} [{lo:.2f}, {hi:.2f}]"
                                             for x, (lo, hi) in zip(a.alphas, a.intervals())),
             f"pooled alpha = {a.pooled_alpha:.3f} (the chapter's uniform-alpha model uses it)", "",
             f"{'K':>3} {'tok/fwd':>8} {'uniform':>8} {'round ms':>9} {'TPOT ms':>8} {'speedup':>8} "
             f"{'textbook':>9}  basis"]
    for p in report.predictions:
        lines.append(f"{p.k:>3} {p.tokens_per_forward:>8.2f} {p.uniform_tokens_per_forward:>8.2f} "
                     f"{p.round_ms:>9.2f} {p.tpot_ms:>8.2f} {p.speedup:>7.2f}x {p.textbook_speedup:>8.2f}x  "
                     f"{p.basis}")
    best = report.best
    lines.append(f"predicted best K = {best.k} ({best.speedup:.2f}x over plain decoding)")
    return "\n".join(lines)

