"""Issue 15's model side on CUDA: sliding-window attention under captured CUDA graphs, a padded-vocabulary
pair with the CUDA kernels, and the memory check against the GPU's free memory."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from spec_fixtures import make_perturbed_copy  # noqa: E402
from test_vocab_and_window import PROMPT, narrow_vocab, set_config, transformers_greedy  # noqa: E402
from tiny_models import make_tiny_llama  # noqa: E402

from engine.analysis.lossless import check_sampling  # noqa: E402
from engine.config import GenerationConfig, SamplingParams  # noqa: E402
from engine.core.decoder import SpeculativeDecoder  # noqa: E402
from engine.errors import SpecplayError  # noqa: E402
from engine.models import loading as models  # noqa: E402
from engine.models import validate  # noqa: E402


def cuda_decoder(target, draft):
    return SpeculativeDecoder(models.load_pair(str(target), str(draft), device="cuda", dtype=torch.float32))


def greedy(decoder, method, n=40, k=4):
    return decoder.generate_ids(PROMPT, GenerationConfig(method=method, k=k, max_new_tokens=n))


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    root = tmp_path_factory.mktemp("windowed_gpu")
    target = set_config(make_tiny_llama(root / "target", arch="mistral", seed=5), sliding_window=6)
    return target, cuda_decoder(target, make_perturbed_copy(target, root / "draft", noise=0.2))


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_sliding_window_on_cuda_equals_transformers(windowed, graphs):
    target, decoder = windowed
    decoder.set_cuda_graphs(graphs)
    plain = greedy(decoder, "none")
    assert plain == transformers_greedy(target, decoder.tokenizer.encode(PROMPT), 40)
    for method in ("draft", "lookahead"):
        assert greedy(decoder, method) == plain, method


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    root = tmp_path_factory.mktemp("padded_gpu")
    target = make_tiny_llama(root / "target", vocab=384, tokenizer_vocab=300, seed=0)
    draft = narrow_vocab(make_perturbed_copy(target, root / "draft", noise=0.1), 320)
    return target, cuda_decoder(target, draft)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_padded_pair_greedy_on_cuda(padded, k):
    target, decoder = padded
    plain = greedy(decoder, "none")
    assert greedy(decoder, "draft", k=k) == plain
    assert plain == transformers_greedy(target, decoder.tokenizer.encode(PROMPT), 40)


def test_padded_pair_sampling_on_cuda(tmp_path):
    target = make_tiny_llama(tmp_path / "target", vocab=48, tokenizer_vocab=30, hidden=32, layers=1, seed=11,
                             std=0.3)
    draft = narrow_vocab(make_perturbed_copy(target, tmp_path / "draft", noise=0.3, seed=2), 40)
    decoder = cuda_decoder(target, draft)
    config = GenerationConfig(method="draft", k=3, sampling=SamplingParams(1.0, 0, 0.9), seed=500)
    report = check_sampling(decoder, "a tea at the tea at", config, samples=1000)
    assert report.bins >= 8 and report.passed, report


def test_memory_check_reads_the_gpu(tmp_path, monkeypatch):
    assert validate.free_memory(torch.device("cuda")) > 0
    path = make_tiny_llama(tmp_path / "m", tokenizer=False)
    monkeypatch.setattr(validate, "free_memory", lambda device: 1 << 10)
    with pytest.raises(SpecplayError, match="free on cuda"):
        models.load_runner(str(path), "cuda")
