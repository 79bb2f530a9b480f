"""Speculative sampling reproduces the target's distribution (chi-squared, fixed seeds)."""

import pytest
from spec_fixtures import make_perturbed_copy
from tiny_models import make_tiny_llama

from engine.analysis.lossless import check_greedy, check_sampling, chi_square
from engine.config import GenerationConfig, SamplingParams
from engine.core.decoder import SpeculativeDecoder
from engine.models.loading import load_pair

VOCAB = 24  # small, so that the exact two-token distribution is cheap and well covered by samples
PROMPT = "a tea at the tea at"
SAMPLES = 1000


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    root = tmp_path_factory.mktemp("lossless")
    target = make_tiny_llama(root / "target", vocab=VOCAB, hidden=32, layers=1, seed=11, std=0.3)
    draft = make_perturbed_copy(target, root / "draft", noise=0.3, seed=2)
    return SpeculativeDecoder(load_pair(str(target), str(draft), device="cpu"))


@pytest.mark.slow  # a statistical or end-to-end check: `make test-fast` skips it
@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_speculative_sampling_matches_target_distribution(decoder, method, temperature):
    config = GenerationConfig(method=method, k=3, sampling=SamplingParams(temperature, 0, 0.9), seed=1000)
    report = check_sampling(decoder, PROMPT, config, samples=SAMPLES)
    assert report.bins >= 8, "too few chi-squared bins for a meaningful test"
    assert report.passed, report


def test_rounds_mix_acceptance_and_rejection(decoder):
    """The chi-squared runs above exercise both paths: accepted drafts and residual sampling."""
    config = GenerationConfig(method="draft", k=3, sampling=SamplingParams(1.0, 0, 0.9), max_new_tokens=60)
    events = list(decoder.generate(PROMPT, config))
    assert 0.1 < events[-1].metrics.acceptance_rate < 0.95


@pytest.mark.slow  # a statistical or end-to-end check: `make test-fast` skips it
def test_the_chi_square_check_catches_a_lossy_verifier(decoder, monkeypatch):
    """Negative control: a verifier that accepts every draft changes the distribution and must FAIL."""
    from engine.kernels import reference

    def accept_all(logits, tokens, probs, uniforms, temperature, top_k=0, top_p=1.0):
        return reference.verify_chain_stochastic(logits, tokens, probs, uniforms * 0.0 - 1.0, temperature,
                                                 top_k, top_p)

    lossy = SpeculativeDecoder(decoder.pair)
    monkeypatch.setattr(lossy, "backend", replace_backend(lossy.backend, verify_chain_stochastic=accept_all))
    config = GenerationConfig(method="draft", k=3, sampling=SamplingParams(1.0, 0, 0.9), seed=1000)
    assert not check_sampling(lossy, PROMPT, config, samples=SAMPLES).passed


def replace_backend(backend, **functions):
    from types import SimpleNamespace

    return SimpleNamespace(**{**vars(backend), **functions})


def test_greedy_check_reports_first_divergence(decoder, monkeypatch):
    config = GenerationConfig(method="draft", k=4, max_new_tokens=30)
    assert check_greedy(decoder, PROMPT, config).passed

    def off_by_one(logits, tokens):
        from engine.kernels import reference

        result = reference.verify_chain_greedy(logits, tokens)
        return result._replace(next_token=(result.next_token + 1) % VOCAB)

    broken = SpeculativeDecoder(decoder.pair)
    monkeypatch.setattr(broken, "backend", replace_backend(broken.backend, verify_chain_greedy=off_by_one))
    plain = SpeculativeDecoder(decoder.pair)
    report = check_greedy(_Mixed(plain, broken), PROMPT, config)
    assert not report.passed and report.first_divergence == 0
    assert report.top2_logit_gap is not None and report.top2_logit_gap >= 0


class _Mixed:
    """Plain decoding through a correct decoder, speculation through a broken one."""

    def __init__(self, plain, broken):
        self.plain, self.broken = plain, broken
        self.tokenizer, self.target, self.vocab_size = plain.tokenizer, plain.target, plain.vocab_size

    def generate_ids(self, prompt, config):
        return (self.plain if config.method == "none" else self.broken).generate_ids(prompt, config)


def test_chi_square_pools_small_bins():
    stat, bins = chi_square({("a",): 50, ("b",): 50}, {("a",): 0.5, ("b",): 0.5}, 100)
    assert stat == pytest.approx(0.0) and bins == 2
    stat, bins = chi_square({("a",): 90, ("b",): 10}, {("a",): 0.5, ("b",): 0.5}, 100)
    assert stat == pytest.approx(64.0)
