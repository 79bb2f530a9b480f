"""Batched decoding on CUDA: greedy equality per sequence (fp32), and the bench's path in bf16 (graphs)."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from spec_fixtures import make_perturbed_copy  # noqa: E402
from test_batch import BUDGETS, PROMPTS  # noqa: E402
from tiny_models import make_tiny_llama  # noqa: E402

from engine.config import GenerationConfig  # noqa: E402
from engine.core.batch import BatchDecoder  # noqa: E402
from engine.core.decoder import SpeculativeDecoder  # noqa: E402
from engine.models.loading import load_pair  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch_gpu")
    target = make_tiny_llama(root / "target", vocab=96, hidden=64, layers=2, seed=0)
    draft = make_perturbed_copy(target, root / "draft", noise=0.3, seed=2)
    return load_pair(str(target), str(draft), device="cuda", dtype=torch.float32)


@pytest.mark.parametrize("method", ["none", "draft", "ngram"])
def test_batched_greedy_equals_plain_on_cuda(pair, method):
    single = SpeculativeDecoder(pair)
    batched = BatchDecoder(pair)
    assert batched.use_graphs
    config = GenerationConfig(method=method, k=3, max_new_tokens=30)
    for _ in range(2):  # the second run replays the graphs the first one captured
        result = batched.generate(PROMPTS, config, budgets=BUDGETS)
        for prompt, budget, seq in zip(PROMPTS, BUDGETS, result.sequences, strict=True):
            want = single.generate_ids(prompt, GenerationConfig(method="none", max_new_tokens=budget))
            assert seq.ids == want, (method, seq.index)


def test_batched_eagle_greedy_equals_plain_on_cuda(tmp_path):
    """EAGLE's chain with the head's steps captured (one feed width, K+1): the second run replays them."""
    from test_batch import add_copied_eagle_head

    target = make_tiny_llama(tmp_path / "target", vocab=96, hidden=64, layers=1, seed=0)
    add_copied_eagle_head(target)
    pair = load_pair(str(target), None, device="cuda", dtype=torch.float32, need_draft=False)
    single = SpeculativeDecoder(pair)
    batched = BatchDecoder(pair)
    assert batched.use_graphs
    config = GenerationConfig(method="eagle", k=3, max_new_tokens=30)
    for _ in range(2):
        result = batched.generate(PROMPTS, config, budgets=BUDGETS)
        for prompt, budget, seq in zip(PROMPTS, BUDGETS, result.sequences, strict=True):
            want = single.generate_ids(prompt, GenerationConfig(method="none", max_new_tokens=budget))
            assert seq.ids == want, seq.index
        assert sum(s.accepted for s in result.sequences) > 0
    assert batched.batch_drafters["eagle"].batch._graphs  # the head's steps were captured


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_bench_batch_on_a_synthetic_pair_in_bf16(method):
    """bench batch --synthetic's path, EAGLE's random head included (its batched features [B, m, H] once
    reached sp_gemv at B = 1 as if they were B rows of m columns)."""
    from engine.bench import batch as batch_bench
    from engine.methods import synthetic_heads
    from engine.models.synthetic import build_synthetic_pair

    built = build_synthetic_pair("tiny", "cuda", torch.bfloat16, max_length=512)
    head = synthetic_heads.batch_eagle_head(built.pair.target) if method == "eagle" else None
    decoder = BatchDecoder(built.pair, eagle_head=head)
    config = GenerationConfig(method=method, k=4, max_new_tokens=16)
    report = batch_bench.bench_batch(decoder, ["def f(x):\n    return", "import os\n"], config, [1, 2, 8],
                                     [1, 2, 4])
    assert [r.batch for r in report.rows] == [1, 2, 8]
    for row in report.rows:
        assert row.plain_tokens_per_s > 0 and row.spec_tokens_per_s > 0 and row.step_ms > 0
        assert row.tokens_per_round >= 1
    assert report.bandwidth > 0 and report.matmul_flops > 0
    assert "crossover" in batch_bench.format_report(report)


@pytest.mark.parametrize("hidden, unsplit, attention", [(64, False, "sp_attention"),
                                                        (128, True, "sp_attention_wide")])
def test_batched_decode_kernels_match_the_sdpa_path_in_bf16(tmp_path, monkeypatch, hidden, unsplit,
                                                             attention):
    """bf16: the batched step on the decode kernels (rope + cache write, attention over each sequence's own
    rows) gives the torch path's logits (rope, indexed writes, mask, SDPA) within bf16 rounding, for ragged
    lengths, a chain block and single tokens. Three sequences of head dim 16 take the split per-head attention
    kernel; of head dim 32, unsplit (as a batch of many sequences is), sp_attention_wide."""
    import engine.kernels.step as step
    from engine.models.batch_runner import BatchRunner

    if unsplit:
        monkeypatch.setattr(step, "ATTENTION_SPLIT_PAIRS", 1)

    path = make_tiny_llama(tmp_path / "m", vocab=96, hidden=hidden, layers=2, seed=3)
    target = load_pair(str(path), None, device="cuda", dtype=torch.bfloat16, need_draft=False).target
    assert target.decode_kernels is not None
    launched, launch = [], target.decode_kernels._launch_grid
    monkeypatch.setattr(target.decode_kernels, "_launch_grid",
                        lambda name, *a, **kw: launched.append(name) or launch(name, *a, **kw))
    outputs = {}
    for label, kernels in (("decode", target.decode_kernels), ("sdpa", None)):
        saved, target.decode_kernels = target.decode_kernels, kernels
        try:
            runner = BatchRunner(target, 3, max_length=128)
            runner.use_graphs = False
            assert runner.decode_path(1) == (kernels is not None)
            gen = torch.Generator().manual_seed(0)
            prompt = torch.randint(0, 96, (3, 20), generator=gen)
            runner.forward(prompt, counts=[20, 13, 7], with_logits=False)
            logits = [runner.forward(torch.randint(0, 96, (3, 5), generator=gen))[0]]
            runner.set_lengths([25, 14, 9])
            for _ in range(3):
                logits.append(runner.forward(torch.randint(0, 96, (3, 1), generator=gen))[0])
            outputs[label] = logits
        finally:
            target.decode_kernels = saved
    for fast, slow in zip(outputs["decode"], outputs["sdpa"], strict=True):
        scale = float(slow.abs().max())
        assert float((fast - slow).abs().max()) <= 0.03 * scale + 0.05
    assert attention in launched and {"sp_attention", "sp_attention_wide"} - {attention} - set(launched)
