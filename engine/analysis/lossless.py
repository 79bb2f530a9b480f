"""check-lossless: prove that speculation did not change the output.

Greedy: speculative output equals plain greedy token for token. Sampling: the first two sampled tokens,
over many seeds, follow the target's exact joint distribution p(x1) p(x2 | x1) (a chi-squared test)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from engine.analysis.analytic import chi2_sf
from engine.bench.suite import kept_session
from engine.config import GenerationConfig, SamplingParams
from engine.core.decoder import SpeculativeDecoder
from engine.errors import SpecplayError

MIN_EXPECTED = 5.0  # chi-squared bins with a smaller expected count are pooled into one "other" bin


@dataclass
class GreedyReport:
    passed: bool
    tokens_compared: int
    first_divergence: Optional[int] = None
    plain_token: Optional[int] = None
    speculative_token: Optional[int] = None
    top2_logit_gap: Optional[float] = None  # target's top-1 minus top-2 logit at the divergence


@dataclass
class ChiSquareReport:
    passed: bool
    samples: int
    bins: int
    statistic: float
    dof: int
    p_value: float
    alpha: float
    observed: dict = field(default_factory=dict)


def _leaves_the_session(check):
    """A check's generations are no one's history: it leaves the decoder's session (suffix decoding's memory)
    as it found it."""
    @functools.wraps(check)
    def checked(decoder, *args, **kwargs):
        with kept_session(decoder):
            return check(decoder, *args, **kwargs)

    return checked


def refuse_synthetic(config: GenerationConfig) -> None:
    """A synthetic profile draws the verdicts (engine.core.synthetic): its output is not the model's by
    design, and a losslessness check of it would prove nothing."""
    if config.synthetic:
        raise SpecplayError("the losslessness check runs on real verification: a synthetic acceptance "
                            f"profile ({config.synthetic_acceptance}) makes the output not the model's")


@_leaves_the_session
def check_greedy(decoder: SpeculativeDecoder, prompt: str, config: GenerationConfig) -> GreedyReport:
    refuse_synthetic(config)
    greedy = replace(config, sampling=SamplingParams())
    plain = decoder.generate_ids(prompt, greedy.plain())
    spec = decoder.generate_ids(prompt, greedy)
    for i, (a, b) in enumerate(zip(plain, spec)):
        if a != b:
            return GreedyReport(False, i + 1, i, a, b, _top2_gap(decoder, prompt, plain[:i]))
    if len(plain) != len(spec):
        i = min(len(plain), len(spec))
        return GreedyReport(False, i, i, None, None, None)
    return GreedyReport(True, len(plain))


def _top2_gap(decoder: SpeculativeDecoder, prompt: str, prefix: list) -> float:
    logits = target_next_logits(decoder, decoder.tokenizer.encode(prompt) + prefix)
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def target_next_logits(decoder: SpeculativeDecoder, ids: list) -> torch.Tensor:
    """The target's logits [V] for the token after ids (a fresh prefill)."""
    target = decoder.target
    with torch.inference_mode():
        target.reset()
        out = target.forward(torch.tensor(ids, dtype=torch.long, device=target.device))
        target.reset()
    return out.logits[-1, :decoder.vocab_size].float().cpu()


def exact_two_token_distribution(decoder: SpeculativeDecoder, prompt: str, sampling: SamplingParams,
                                 min_prob: float = 1e-6,
                                 should_stop: Optional[Callable[[], bool]] = None) -> dict:
    """{(x1, x2): p(x1) p(x2 | x1)} under the target's warped distribution, pairs above min_prob
    (empty when should_stop() turned true before the end)."""
    from engine.kernels.reference import warp_probs

    ids = decoder.tokenizer.encode(prompt)

    def warp(logits):
        return warp_probs(logits[None], sampling.temperature, sampling.top_k, sampling.top_p)[0]

    p1 = warp(target_next_logits(decoder, ids))
    joint = {}
    for x1 in torch.nonzero(p1 > min_prob).flatten().tolist():
        if should_stop is not None and should_stop():
            return {}
        p2 = warp(target_next_logits(decoder, ids + [x1])) * p1[x1]
        for x2 in torch.nonzero(p2 > min_prob).flatten().tolist():
            joint[(x1, x2)] = float(p2[x2])
    return joint


@_leaves_the_session
def check_sampling(decoder: SpeculativeDecoder, prompt: str, config: GenerationConfig, samples: int = 2000,
                   significance: float = 0.001,
                   should_stop: Optional[Callable[[], bool]] = None,
                   progress: Optional[Callable[[int, int], None]] = None) -> Optional[ChiSquareReport]:
    """Chi-squared goodness of fit of the first two speculative tokens (seeds config.seed ... + samples).
    None when should_stop() turned true before the end. progress(done, samples), when given, is called
    after each seed."""
    refuse_synthetic(config)
    stopped = should_stop or (lambda: False)
    expected = exact_two_token_distribution(decoder, prompt, config.sampling, should_stop=stopped)
    counts: dict = {}
    for i in range(samples):
        if stopped():
            return None
        run = replace(config, seed=config.seed + i, max_new_tokens=2, stop_at_eos=False)
        pair = tuple(decoder.generate_ids(prompt, run)[:2])
        counts[pair] = counts.get(pair, 0) + 1
        if progress is not None:
            progress(i + 1, samples)
    statistic, bins = chi_square(counts, expected, samples)
    dof = max(bins - 1, 1)
    p_value = chi2_sf(statistic, dof)
    return ChiSquareReport(p_value >= significance, samples, bins, statistic, dof, p_value, significance,
                           {f"{a},{b}": n
                            for (a, b), n in sorted(counts.items(), key=lambda kv: -kv[1])[:10]})


def greedy_summary(report: GreedyReport, describe_token: Callable[[int], str] = str) -> str:
    """One line for people: PASS with the tokens compared, or where and how plain and speculative output
    differ."""
    if report.passed:
        return f"greedy: PASS ({report.tokens_compared} generated tokens identical to plain greedy decoding)"
    if report.plain_token is None:
        return (f"greedy: FAIL the outputs have different lengths after {report.first_divergence} identical "
                "tokens")
    return (f"greedy: FAIL first divergence at generated position {report.first_divergence}: plain "
            f"{describe_token(report.plain_token)} vs speculative "
            f"{describe_token(report.speculative_token)}; "
            f"target top-2 logit gap there {report.top2_logit_gap:.4g}")


def sampling_summary(report: ChiSquareReport, sampling: SamplingParams) -> str:
    verdict = "PASS" if report.passed else "FAIL"
    return (f"sampling (T={sampling.temperature}, top-k={sampling.top_k}, top-p={sampling.top_p}, "
            f"first two tokens, "
            f"{report.samples} seeds): {verdict} chi2={report.statistic:.2f} dof={report.dof} "
            f"p={report.p_value:.4f} (fail below {report.alpha})")


def chi_square(counts: dict, probabilities: dict, samples: int) -> tuple[float, int]:
    """Pearson's statistic over the outcomes with expected count >= MIN_EXPECTED plus one pooled bin for the
    rest (including outcomes the exact distribution gives ~0). Returns (statistic, number of bins)."""
    statistic, bins = 0.0, 0
    pooled_expected, pooled_observed = float(samples), samples
    for outcome, prob in probabilities.items():
        expected = prob * samples
        if expected < MIN_EXPECTED:
            continue
        observed = counts.get(outcome, 0)
        statistic += (observed - expected) ** 2 / expected
        bins += 1
        pooled_expected -= expected
        pooled_observed -= observed
    if pooled_expected >= MIN_EXPECTED:
        statistic += (pooled_observed - pooled_expected) ** 2 / pooled_expected
        bins += 1
    elif pooled_observed > 3 * MIN_EXPECTED:
        statistic += float("inf")  # mass where the target puts (almost) none
    return statistic, bins
