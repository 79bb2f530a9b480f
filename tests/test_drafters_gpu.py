"""Suffix decoding and layer skip on CUDA: greedy equality (layer skip's captured draft chains included) and
chi-squared losslessness."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from tiny_models import make_tiny_llama  # noqa: E402

from engine.analysis.lossless import check_sampling  # noqa: E402
from engine.config import GenerationConfig, SamplingParams  # noqa: E402
from engine.core.decoder import SpeculativeDecoder  # noqa: E402
from engine.models.loading import load_pair  # noqa: E402

PROMPT = "the cat sat on the mat. the cat sat on the"
METHODS = [("suffix", {}), ("suffix", {"tree_nodes": 16}), ("layerskip", {"draft_layers": 1}),
           ("layerskip", {"draft_layers": 2})]


def build(root, vocab, hidden, layers, seed, std):
    target = make_tiny_llama(root / "target", vocab=vocab, hidden=hidden, layers=layers, seed=seed,
                             std=std)
    pair = load_pair(str(target), None, device="cuda", need_draft=False, dtype=torch.float32)
    return SpeculativeDecoder(pair)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return build(tmp_path_factory.mktemp("gpu_new"), 96, 64, 3, 0, 0.15)


@pytest.mark.parametrize("method,extra", METHODS)
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_equals_plain_on_cuda(decoder, method, extra, k):
    plain = decoder.generate_ids(PROMPT, GenerationConfig(method="none", max_new_tokens=48))
    for _ in range(2):  # suffix: the second run drafts from the session memory; layer skip: graphs replayed
        spec = decoder.generate_ids(PROMPT, GenerationConfig(method=method, k=k, max_new_tokens=48, **extra))
        assert spec == plain


@pytest.fixture(scope="module")
def small_vocab_decoder(tmp_path_factory):
    return build(tmp_path_factory.mktemp("gpu_new_chi"), 24, 32, 3, 11, 0.3)


@pytest.mark.parametrize("method,extra", METHODS)
def test_sampling_is_lossless_on_cuda(small_vocab_decoder, method, extra):
    config = GenerationConfig(method=method, k=3, sampling=SamplingParams(0.8, 0, 0.9), seed=1000, **extra)
    report = check_sampling(small_vocab_decoder, "a tea at the tea at", config, samples=1000)
    assert report.bins >= 8 and report.passed, report
