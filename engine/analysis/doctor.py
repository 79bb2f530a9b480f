"""The head doctor: why does a draft head accept less than expected?

For any head it measures the acceptance by draft position (with 95 % Wilson intervals) over a few prompts and,
for a reduced draft vocabulary, the share of the prompts' and outputs' tokens the head can draft at all. For a
published EAGLE-3 head it also measures each convention its config leaves open: the tapped layers as written
(transformers' hidden_states[k], the residual stream before layer k), one layer earlier and one later (a head
trained on "the output of layer k" reads one layer later), and both settings of norm_before_residual. The
convention that accepts most is the one the head was evidently trained with; the findings say so in words.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from engine.analysis.acceptance import DepthAcceptance, RoundShape
from engine.config import GenerationConfig

TAP_SHIFTS = (0, -1, 1)  # as written first: a tie keeps the config's own convention
CLEAR_MARGIN = 0.10  # tokens per forward by which another convention must win to be named a mismatch


@dataclass
class ConventionResult:
    label: str
    taps: tuple
    before_residual: bool
    acceptance: DepthAcceptance
    tokens_per_forward: float

    def summary(self) -> str:
        alphas = ", ".join(f"{a:.2f} [{lo:.2f}, {hi:.2f}]" for a, (lo, hi)
                           in zip(self.acceptance.alphas, self.acceptance.intervals()))
        return f"{self.label}: {self.tokens_per_forward:.2f} tokens/forward; α by position {alphas}"


@dataclass
class DoctorReport:
    method: str
    description: str
    k: int
    results: List[ConventionResult]
    coverage: Optional[float] = None  # share of prompt + output tokens inside the draft vocabulary
    findings: List[str] = field(default_factory=list)

    @property
    def as_written(self) -> ConventionResult:
        return self.results[0]

    @property
    def best(self) -> ConventionResult:
        return max(self.results, key=lambda r: r.tokens_per_forward)

    def format(self) -> str:
        lines = [f"heads: {self.description}", f"method {self.method}, K = {self.k}, greedy"]
        lines += ["  " + r.summary() for r in self.results]
        if self.coverage is not None:
            lines.append(f"draft vocabulary covers {100 * self.coverage:.1f}% of the prompts' and outputs' "
                         "tokens")
        lines += ["finding: " + f for f in self.findings]
        return "\n".join(lines)


def measure(decoder, prompts: Sequence[str], config: GenerationConfig) -> tuple:
    """(DepthAcceptance, tokens per forward, every token of prompts and outputs) of greedy runs."""
    rounds, emitted, tokens = [], 0, []
    for prompt in prompts:
        tokens += decoder.prompt_ids(prompt)
        for event in decoder.generate(prompt, config):
            depth = max((d.depth + 1 for d in event.drafted), default=0)
            rounds.append(RoundShape(depth=depth, accepted=event.accepted_count))
            emitted += len(event.emitted_ids)
            tokens += list(event.emitted_ids)
    return DepthAcceptance.from_rounds(rounds), emitted / max(len(rounds), 1), tokens


def conventions(head, target_layers: int) -> list:
    """(label, taps, before_residual) for each convention to try; only the config's own for other heads."""
    written = getattr(head, "taps_as_written", None)
    if written is None or not hasattr(head, "set_convention"):
        return [("as loaded", (), False)]
    own = head.before_residual
    out = []
    for shift in TAP_SHIFTS:
        taps = tuple(t + shift for t in written)
        if not all(1 <= t < target_layers for t in taps):
            continue
        where = {0: "as written", -1: "one layer earlier", 1: "one layer later"}[shift]
        for before in (own, not own):
            label = f"taps {list(taps)} ({where}), norm_before_residual={before}"
            out.append((label + (" [config]" if shift == 0 and before == own else ""), taps, before))
    return out


def diagnose_heads(decoder, method: str, prompts: Sequence[str], k: int = 4,
                   max_new_tokens: int = 48) -> DoctorReport:
    """Run the loaded heads of `method` (eagle, eagle3, medusa) under each convention; the head is left in
    the convention it was loaded with."""
    loaders = {"eagle": decoder.eagle_head, "eagle3": decoder.eagle3_head, "medusa": decoder.medusa_heads}
    head = loaders[method]()
    config = GenerationConfig(method=method, k=k, max_new_tokens=max_new_tokens)
    layers = len(getattr(decoder.target, "layers", ()))
    options = conventions(head, layers)
    original = (getattr(head, "taps_as_written", ()), getattr(head, "before_residual", False))
    results, tokens = [], []
    try:
        for label, taps, before in options:
            if taps:
                head.set_convention(taps, before)
            acceptance, per_forward, seen = measure(decoder, prompts, config)
            tokens = tokens or seen
            results.append(ConventionResult(label, taps, before, acceptance, per_forward))
    finally:
        if options[0][1]:
            head.set_convention(*original)
    info = getattr(decoder, "heads_info", None)
    if info is not None:  # describe() begins "heads: FOLDER", and the report prints "heads: " itself
        description = info.describe().removeprefix("heads: ")
    elif getattr(head, "info", None) is not None:  # a published head in the target's own folder
        description = f"the target's own {method} heads in {head.info.describe().removeprefix('heads: ')}"
    else:
        description = f"the target's own {method} heads"
    report = DoctorReport(method, description, k, results, _coverage(head, tokens))
    report.findings = findings(report)
    return report


def _coverage(head, tokens: list) -> Optional[float]:
    """The share of tokens a reduced draft vocabulary can draft (None for a full vocabulary)."""
    ids = getattr(head, "target_ids", None)
    if ids is None or not tokens:
        return None
    inside = set(ids.tolist())
    return sum(1 for t in tokens if t in inside) / len(tokens)


def findings(report: DoctorReport) -> list:
    out = []
    written, best = report.as_written, report.best
    if best is not written and best.tokens_per_forward >= written.tokens_per_forward + CLEAR_MARGIN:
        out.append(f"the head accepts most with {best.label} ({best.tokens_per_forward:.2f} tokens/forward "
                   f"against {written.tokens_per_forward:.2f} as configured): it was evidently trained with "
                   "that convention; serve it so (engines differ in how they count tapped layers)")
    elif len(report.results) > 1:
        out.append(f"the configured convention accepts most ({written.tokens_per_forward:.2f} tokens a "
                   "forward): no convention mismatch")
    alphas = written.acceptance.alphas
    if alphas and alphas[0] < 0.3:
        out.append(f"the first draft position is accepted {alphas[0]:.0%} of the time: the head does not fit "
                   "this target (another target's head, a different fine-tune, or the wrong layers)")
    if report.coverage is not None and report.coverage < 0.9:
        out.append(f"{100 * (1 - report.coverage):.0f}% of the tokens lie outside the draft vocabulary and "
                   "can never be drafted: a vocabulary mapping (d2t) for another tokenizer or domain")
    return out


def default_prompts(count: int) -> list:
    from engine.bench.suite import heldout_prompts

    return heldout_prompts(count)

