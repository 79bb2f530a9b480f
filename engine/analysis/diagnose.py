"""Why is it slow? The chapter's symptom -> suspect list as rules over a run's measured figures.

Each Finding names the figure it rests on, so the GUI can point at it and the CLI can print it. The rules read
a Trace (engine.analysis.predict) and a cost model refitted on it; the thresholds are the constants below.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from engine.analysis.costmodel import CostModel
from engine.analysis.predict import PredictionReport, Trace, predict_from_trace

LOW_ALPHA = 0.5  # alpha at the first depth below this: the draft disagrees with the target too often
HIGH_C = 0.3  # one draft step costs more than this share of a plain verification
OVERHEAD_SHARE = 0.35  # host bookkeeping above this share of a round
K_MARGIN = 1.05  # another K predicted at least 5 % faster
COMPUTE_BOUND = 2.5  # verifying K + 1 tokens costs this many one-token forwards or more
MISS_SHARE = 0.2  # a lookup drafter that proposed nothing in more than this share of its rounds
LOOKUP_ADVICE = {  # what fills a lookup drafter's empty rounds
    "ngram": "the context repeats itself too little for prompt lookup: suffix decoding also searches the "
             "session's earlier outputs and a corpus",
    "ngram, no table": "the context repeats itself too little for prompt lookup: the target's corpus "
                       "table (--ngram-corpus on, the GPU's default) fills its empty slots, or suffix "
                       "decoding also searches the session's earlier outputs and a corpus",
    "suffix": "neither the context nor the session holds a match: give it a corpus of similar text "
              "(--suffix-corpus), or run similar prompts in the same session",
    "lookahead": "its n-gram pool has nothing for this context yet: it fills as the generation goes on",
}


@dataclass(frozen=True)
class PhaseBar:
    label: str
    draft_ms: float
    verify_ms: float
    overhead_ms: float
    tokens: float  # tokens the round yields

    @property
    def total_ms(self) -> float:
        return self.draft_ms + self.verify_ms + self.overhead_ms

    @property
    def per_token_ms(self) -> float:
        return self.total_ms / max(self.tokens, 1e-9)


@dataclass(frozen=True)
class Finding:
    rule: str  # low_alpha, lookup_misses, c_too_high, overhead, k_past_optimum, large_batch, output_changed,
    # slower
    title: str
    advice: str
    figure: str  # the figure it rests on, with its value

    def line(self) -> str:
        return f"[{self.rule}] {self.title}: {self.advice} (figure: {self.figure})"


@dataclass
class Diagnosis:
    findings: list
    bars: list  # [PhaseBar]: the plain round (TPOT_plain), then the run's mean round (its measured TPOT)
    round_bars: list  # [PhaseBar] a bar per round
    report: PredictionReport
    # the headline: "slower than plain decoding (0.56×)" or "faster ..." with the dominant cause (None for a
    # plain run)
    verdict: Optional[Finding] = None
    speedup: Optional[float] = None  # TPOT_plain over the run's TPOT (plain bar's ms a token over the run's)

    def rules(self) -> list:
        return [f.rule for f in self.findings]


def phase_bars(trace: Trace, costs: CostModel, plain_ms: Optional[float] = None,
               plain_source: str = "cost model") -> tuple:
    """(summary bars: a plain round and the run's mean round; a bar per round). The plain round is the cost
    model's split of a plain round (verify, overhead) scaled to plain_ms (TPOT_plain, as the caller measured
    or calibrated it), the cost model's own plain round without it. The run's bar is the mean of its rounds,
    so its ms a token is the run's measured TPOT (a round's time is its three phases)."""
    rounds = [r for r in trace.rounds if r.method != "none"] or trace.rounds
    per_round = [PhaseBar(f"round {i}", r.timing.draft_ms, r.timing.verify_ms, r.timing.overhead_ms,
                          len(r.emitted)) for i, r in enumerate(rounds)]
    verify, overhead = costs.t_verify(1), costs.t_overhead("none")
    if plain_ms is not None and verify + overhead > 0:
        scale = plain_ms / (verify + overhead)
        verify, overhead = verify * scale, overhead * scale
    plain = PhaseBar(f"plain round ({plain_source})", 0.0, verify, overhead, 1.0)
    label = "plain decoding round (mean)" if trace.method == "none" else f"{trace.method} round (mean)"
    mean = PhaseBar(label, _mean(b.draft_ms for b in per_round), _mean(b.verify_ms for b in per_round),
                    _mean(b.overhead_ms for b in per_round), _mean(b.tokens for b in per_round))
    return [plain, mean], per_round


def _mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else 0.0


def diagnose(trace: Trace, costs: Optional[CostModel] = None, ks: Sequence[int] = range(1, 17),
             reference_output: Optional[list] = None, plain_ms: Optional[float] = None,
             plain_source: str = "cost model") -> Diagnosis:
    """Run every rule. reference_output: plain decoding's token ids for the same prompt (greedy), if known;
    plain_ms: TPOT_plain as the caller shows it everywhere (a measured plain run's, or the calibration's),
    named by plain_source; without it, the cost model's plain round."""
    report = predict_from_trace(trace, sorted(set(ks) | {trace.k}), costs)
    bars, round_bars = phase_bars(trace, report.costs, plain_ms, plain_source)
    findings = []
    for rule in (_low_alpha, _lookup_misses, _c_too_high, _overhead, _k_past_optimum, _large_batch):
        finding = rule(trace, report, bars)
        if finding is not None:
            findings.append(finding)
    changed = _output_changed(trace, reference_output)
    if changed is not None:
        findings.append(changed)
    slower = _slower(trace, bars)
    if slower is not None:
        findings.insert(0, slower)
    factor = _speedup(trace, bars)
    return Diagnosis(findings, bars, round_bars, report, _verdict(factor, findings, bars), factor)


def _speedup(trace, bars) -> Optional[float]:
    """TPOT_plain over the run's TPOT: the plain bar's ms a token over the run's (None for plain decoding)."""
    plain, run = bars
    if trace.method == "none" or run.per_token_ms <= 0:
        return None
    return plain.per_token_ms / run.per_token_ms


def _verdict(factor: Optional[float], findings: list, bars) -> Optional[Finding]:
    """The headline: slower or faster than plain decoding, by how much, and the dominant cause (the first
    finding, else the phase that takes most of a round)."""
    if factor is None:
        return None
    plain, run = bars
    causes = [f for f in findings if f.rule != "slower"]
    if causes:
        cause = causes[0].title
    else:
        phase = max(("draft", "verify", "overhead"), key=lambda name: getattr(run, name + "_ms"))
        share = getattr(run, phase + "_ms") / run.total_ms if run.total_ms > 0 else 0.0
        cause = f"{phase} takes {100 * share:.0f} % of a round"
    word = "faster" if factor >= 1.0 else "slower"
    return Finding(word, f"{word} than plain decoding ({factor:.2f}×)", cause,
                   f"{run.per_token_ms:.2f} ms a token against TPOT_plain {plain.per_token_ms:.2f} ms "
                   f"({plain.label.split('(', 1)[-1].rstrip(')')})")


def _low_alpha(trace, report, bars) -> Optional[Finding]:
    drafted = trace.drafted_acceptance()  # where the drafter proposed something: a miss is no rejection
    alphas = drafted.alphas
    if trace.method == "none" or not alphas or alphas[0] >= LOW_ALPHA:
        return None
    lo, hi = drafted.intervals()[0]
    return Finding("low_alpha", f"low acceptance: α₁ = {alphas[0]:.2f}",
                   "the draft is misaligned with the target: distill the draft on the target's outputs, "
                   "switch to EAGLE, or lower K",
                   f"per-depth acceptance α₁ = {alphas[0]:.2f} [{lo:.2f}, {hi:.2f}]")


def _lookup_misses(trace, report, bars) -> Optional[Finding]:
    """A lookup drafter (n-gram, suffix, lookahead) that often found nothing to propose: those rounds are
    plain decoding steps, whatever its acceptance where it did propose."""
    key = "ngram, no table" if trace.method == "ngram" and not trace.uses_ngram_table else trace.method
    advice = LOOKUP_ADVICE.get(key)
    rounds = trace.rounds
    missed = sum(1 for r in rounds if not r.drafted)
    if advice is None or not rounds or missed <= MISS_SHARE * len(rounds):
        return None
    return Finding("lookup_misses", f"nothing drafted in {100 * missed / len(rounds):.0f} % of the rounds",
                   advice, f"rounds that drafted nothing: {missed} of {len(rounds)}")


def _c_too_high(trace, report, bars) -> Optional[Finding]:
    c = report.costs.c(trace.method)
    if trace.method == "none" or c <= HIGH_C:
        return None
    return Finding("c_too_high", f"drafting is expensive: c = {c:.2f}",
                   "a draft step costs too much of a target forward: use a smaller draft model or heads "
                   "(Medusa, EAGLE)", f"c = t_draft step / t_verify(1) = {c:.2f}")


def _overhead(trace, report, bars) -> Optional[Finding]:
    run = bars[1]
    share = run.overhead_ms / run.total_ms if run.total_ms > 0 else 0.0
    if share <= OVERHEAD_SHARE:
        return None
    return Finding("overhead", f"overhead-dominated rounds: {100 * share:.0f} % bookkeeping",
                   "the round is host-bound at this model size: acceptance, rollback and detokenisation "
                   "cost more than the forwards they serve (a larger model, or a device-resident round)",
                   f"phase bars: overhead {run.overhead_ms:.2f} of {run.total_ms:.2f} ms a round")


def _k_past_optimum(trace, report, bars) -> Optional[Finding]:
    by_k = {p.k: p for p in report.predictions}
    current, best = by_k.get(trace.k), report.best
    if trace.method == "none" or current is None or best.k == trace.k:
        return None
    if best.speedup < current.speedup * K_MARGIN:
        return None
    direction = "lower" if best.k < trace.k else "raise"
    advice = f"{direction} K to {best.k}: predicted {best.speedup:.2f}x against {current.speedup:.2f}x"
    if best.k > trace.k and best.basis not in ("exact", "exact (replayed)"):  # depths it never drafted
        advice += f" (extrapolated past this run's K = {trace.k}: Find the fastest K measures it)"
    title = f"K = {trace.k} is off its optimum (predicted best K = {best.k})"
    return Finding("k_past_optimum", title, advice,
                   f"counterfactual K curve: speedup({best.k}) = {best.speedup:.2f}x, "
                   f"speedup({trace.k}) = {current.speedup:.2f}x")


def _large_batch(trace, report, bars) -> Optional[Finding]:
    costs = report.costs
    block = max((r.timing.block for r in trace.rounds), default=1)
    ratio = costs.t_verify(block) / costs.t_verify(1) if costs.t_verify(1) > 0 else 1.0
    if trace.batch <= 1 and ratio < COMPUTE_BOUND:
        return None
    figure = (f"verify curve: t_verify({block}) = {ratio:.1f} × t_verify(1)" if trace.batch <= 1 else
              f"batch = {trace.batch}; verify curve t_verify({block}) = {ratio:.1f} × t_verify(1)")
    return Finding("large_batch", "verification is compute-bound",
                   "the idle compute speculation spends is gone (a large batch, or a CPU): the extra drafted "
                   "tokens cost nearly full price; lower K or the batch (see the batch regime)", figure)


def _output_changed(trace, reference_output) -> Optional[Finding]:
    bad = [i for i, r in enumerate(trace.rounds) if r.greedy_violation]
    if bad:
        return Finding("output_changed", "output changed: not lossless",
                       "a greedy round emitted a token that is not the target's top choice: run "
                       "`main.py check-lossless` with this method", f"greedy check: round {bad[0]}")
    if reference_output is None or not trace.greedy or not trace.generations:
        return None
    output = [t for r in trace.generations[0] for t in r.emitted]
    n = min(len(output), len(reference_output))
    first = next((i for i in range(n) if output[i] != reference_output[i]), None)
    if first is None:
        return None
    return Finding("output_changed", "output changed: not lossless",
                   "speculative greedy output differs from plain greedy decoding: "
                   "run `main.py check-lossless`",
                   f"greedy output vs plain: first difference at token {first}")


def _slower(trace, bars) -> Optional[Finding]:
    plain, run = bars
    if trace.method == "none" or run.per_token_ms <= plain.per_token_ms:
        return None
    return Finding("slower", "speculation is slower than plain decoding here",
                   "see the findings below for why",
                   f"phase bars: {run.per_token_ms:.2f} ms a token against {plain.per_token_ms:.2f} ms plain")


def format_diagnosis(d: Diagnosis) -> str:
    lines = ["phase bars (ms a round: draft / verify / overhead, tokens a round):"]
    for bar in d.bars:
        lines.append(f"  {bar.label:<28} {bar.draft_ms:7.2f} / {bar.verify_ms:7.2f} / {bar.overhead_ms:7.2f}"
                     f"  = {bar.total_ms:7.2f} ms, {bar.tokens:.2f} tokens, "
                     f"{bar.per_token_ms:.2f} ms a token")
    if d.verdict is not None:
        lines.insert(0, f"verdict: {d.verdict.title}; {d.verdict.advice} (figure: {d.verdict.figure})")
    lines.append("findings:" if d.findings else "findings: none (the run looks healthy)")
    lines += [f"  {f.line()}" for f in d.findings]
    return "\n".join(lines)
