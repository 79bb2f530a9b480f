"""Chain blocks padded to a bucket (engine.models.llama.block_bucket), on the CPU with padding forced on
(fp32):
the padded block gives the unpadded block's outputs, leaves the cache at the real length, its padding rows
stay out of every later step, and generation gives the same tokens."""
import pytest
import torch
from spec_fixtures import make_perturbed_copy
from test_tree_methods import add_random_eagle3_head
from tiny_models import make_tiny_llama

from engine.config import GenerationConfig
from engine.core.decoder import SpeculativeDecoder
from engine.models import llama
from engine.models.llama import LlamaRunner, block_bucket, is_bucket
from engine.models.loading import load_pair

PROMPT = "the cat sat on the mat. the cat sat on the"  # 42 tokens: a prefill of 41, padded to 64
SHORT_PROMPT = "a tea at the tea at"  # a prefill of 18, padded to 32
TIGHT = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("buckets")
    target = make_tiny_llama(root / "target", hidden=64, layers=2, seed=0)
    add_random_eagle3_head(target, 64, taps=(0, 1))
    make_perturbed_copy(target, root / "draft", noise=0.3, seed=2)
    return target


def make_runner(path, pad: bool, max_length=None) -> LlamaRunner:
    runner = LlamaRunner.from_pretrained(path, dtype=torch.float32, max_length=max_length)
    runner.pad_blocks = pad
    return runner


def record_rows(runner) -> list:
    """The rows of every block the runner steps (padding included), appended as it runs."""
    rows = []
    step = runner.block_step

    def spy(x, *args):
        rows.append(x.shape[0])
        return step(x, *args)

    runner.block_step = spy
    return rows


def ids(n: int, offset: int = 0) -> torch.Tensor:
    return (torch.arange(offset, offset + n) * 7 + 3) % 96  # [n]


def test_bucket_rule():
    assert [block_bucket(n) for n in range(1, 9)] == list(range(1, 9))
    assert [block_bucket(n) for n in (9, 15, 16, 17, 32, 33, 63, 64, 65, 128, 129)] == \
        [16, 16, 16, 32, 32, 64, 64, 64, 128, 128, 192]
    assert [n for n in range(1, 200) if is_bucket(n)] == [16, 32, 64, 128, 192]


def test_padding_is_on_only_on_cuda_by_default(model_dir):
    assert LlamaRunner.from_pretrained(model_dir, dtype=torch.float32).pad_blocks is False


@pytest.mark.parametrize("n", [9, 15, 16, 17, 27, 32, 38, 64, 65, 100])
def test_padded_prefill_equals_unpadded(model_dir, n):
    padded, plain = make_runner(model_dir, True), make_runner(model_dir, False)
    padded.tap_layers = plain.tap_layers = (0, 1)
    rows = record_rows(padded)
    a, b = padded.forward(ids(n)), plain.forward(ids(n))
    assert rows == [block_bucket(n)]
    assert padded.length == plain.length == n
    assert a.logits.shape == (n, 96) and a.hidden.shape == (n, 64) and a.taps.shape == (n, 128)
    torch.testing.assert_close(a.logits, b.logits, **TIGHT)
    torch.testing.assert_close(a.hidden, b.hidden, **TIGHT)
    torch.testing.assert_close(a.taps, b.taps, **TIGHT)
    assert padded.last_taps.shape == (n, 128)


@pytest.mark.parametrize("wide", [False, True], ids=["kv=rows", "kv=cache"])
def test_padding_rows_stay_hidden_from_later_steps(model_dir, wide):
    """After a padded prefill, one-token steps and further (padded) chains give the unpadded runner's logits.
    wide: every step attends over the whole cache (as a GPU's rounded-up kv width does), so the stale padding
    rows are inside the attention and only the mask keeps them out."""
    padded, plain = make_runner(model_dir, True), make_runner(model_dir, False)
    if wide:
        for runner in (padded, plain):
            runner.kv_width = lambda rows, r=runner: r.max_length
    padded.forward(ids(27)), plain.forward(ids(27))
    # the padding's K/V sit in rows 27..31, past the length (a fresh cache holds zeros there)
    assert padded.kv[:, :, :, 27:32].abs().sum() > 0 and plain.kv[:, :, :, 27:32].abs().sum() == 0
    for n, offset in ((1, 27), (1, 28), (5, 29), (12, 34), (1, 46)):
        a, b = padded.forward(ids(n, offset)), plain.forward(ids(n, offset))
        torch.testing.assert_close(a.logits, b.logits, **TIGHT)
        assert padded.length == plain.length == offset + n


def test_rollback_after_a_padded_block(model_dir):
    """A verification-sized chain of 12 runs padded to 16; rolled back inside it, the next step is the
    unpadded runner's."""
    padded, plain = make_runner(model_dir, True), make_runner(model_dir, False)
    for runner in (padded, plain):
        runner.forward(ids(20))
        runner.forward(ids(12, 20))
        runner.rollback(25)
    torch.testing.assert_close(padded.forward(ids(1, 40)).logits, plain.forward(ids(1, 40)).logits, **TIGHT)


def test_no_padding_past_max_length(model_dir):
    padded, plain = make_runner(model_dir, True, max_length=40), make_runner(model_dir, False, max_length=40)
    rows = record_rows(padded)
    padded.forward(ids(27)), plain.forward(ids(27))  # 32 rows fit
    a, b = padded.forward(ids(12, 27)), plain.forward(ids(12, 27))  # 27 + 16 > 40: unpadded
    assert rows == [32, 12] and padded.length == 39
    torch.testing.assert_close(a.logits, b.logits, **TIGHT)
    padded.reset()
    padded.forward(ids(38))  # its bucket, 64, exceeds the cache
    assert rows[-1] == 38 and padded.length == 38


def test_trees_are_not_padded(model_dir):
    padded, plain = make_runner(model_dir, True), make_runner(model_dir, False)
    rows = record_rows(padded)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3, 4, 5, 6])  # 11 nodes
    padded.forward(ids(4)), plain.forward(ids(4))
    a, b = padded.forward(ids(11, 4), parents), plain.forward(ids(11, 4), parents)
    assert rows == [4, 11]
    torch.testing.assert_close(a.logits, b.logits, **TIGHT)


def test_forward_asks_for_a_bucket_graph_only_when_padded(model_dir):
    """What _forward tells _captured_step: the rows it runs and whether they are a padded bucket."""
    runner = make_runner(model_dir, True, max_length=48)
    asked = []
    runner._captured_step = lambda n, start, bucketed=False: asked.append((n, start, bucketed))
    runner.forward(ids(27))
    runner.forward(ids(1, 27))
    runner.forward(ids(16, 28))  # a bucket already: no padding rows, still bucketed
    runner.reset()
    runner.forward(ids(40))  # 64 rows do not fit: unpadded
    runner.reset()
    runner.forward(ids(5))  # short: never padded
    assert asked == [(32, 0, True), (1, 27, False), (16, 28, True), (40, 0, False), (5, 0, False)]


def test_capture_policy_at_the_cache_start(model_dir, monkeypatch):
    """At start 0 only a bucketed block of up to PREFILL_GRAPH_ROWS rows is captured: on the decode path keyed
    (n, 0, taps) as at any start, off it keyed by the kv width its bucket fixes; past the start, blocks of up
    to GRAPH_MAX_BLOCK rows."""
    built = []

    class FakeStep:
        def __init__(self, runner, n, kv, pool):
            built.append((n, kv))

    monkeypatch.setattr(llama, "CapturedStep", FakeStep)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    runner = make_runner(model_dir, True)
    runner.use_graphs = True
    runner.decode_kernels = object()  # the decode path only asks whether there are kernels
    assert runner._captured_step(27, 0) is None  # an unpadded prefill
    assert runner._captured_step(5, 0) is None
    step = runner._captured_step(32, 0, bucketed=True)
    assert isinstance(step, FakeStep) and list(runner._graphs) == [(32, 0, ())]
    assert runner._captured_step(32, 0, bucketed=True) is step
    assert runner._captured_step(32, 70, bucketed=True) is step  # one graph for every start
    assert runner._captured_step(128, 0, bucketed=True) is not None  # a prefill bucket past the decode path
    assert runner._captured_step(llama.PREFILL_GRAPH_ROWS + 64, 0, bucketed=True) is None
    assert runner._captured_step(128, 10) is None  # past GRAPH_MAX_BLOCK after the start
    runner.decode_kernels = None  # the cuBLAS + SDPA path: its key holds the kv width
    assert runner._captured_step(32, 0) is None  # unpadded
    assert runner._captured_step(32, 0, bucketed=True) is not None
    assert runner._captured_step(32, 10, bucketed=True) is not None
    assert built == [(32, 0), (128, 128), (32, 32), (32, 42)]  # kv widths of a CPU runner: rows themselves


def test_warm_up_buckets_runs_each_bucket_and_resets(model_dir):
    runner = make_runner(model_dir, True)
    rows = record_rows(runner)
    runner.forward(ids(5))
    runner.warm_up_buckets()
    assert rows == [5, 16, 32, 64, 128, 192, 256] and runner.length == 0
    short = make_runner(model_dir, True, max_length=40)
    short_rows = record_rows(short)
    short.warm_up_buckets()
    assert short_rows == [16, 32] and short.length == 0
    plain = make_runner(model_dir, False)
    plain_rows = record_rows(plain)
    plain.warm_up_buckets()
    assert plain_rows == []


def test_decoder_warm_up_is_free_on_the_cpu(model_dir):
    decoder = SpeculativeDecoder(load_pair(str(model_dir), str(model_dir.parent / "draft"), device="cpu"))
    rows = record_rows(decoder.target)
    warmed = []
    decoder.backend = type("Backend", (), {"warm_up": lambda self: warmed.append(1)})()
    decoder.warm_up()
    assert warmed == [1] and rows == [] and decoder.target.length == 0


@pytest.fixture(scope="module")
def decoder(model_dir):
    return SpeculativeDecoder(load_pair(str(model_dir), str(model_dir.parent / "draft"), device="cpu"))


def set_padding(decoder, on: bool) -> None:
    for runner in (decoder.target, decoder.pair.draft, decoder.eagle3_head().runner):
        runner.pad_blocks = on


@pytest.mark.parametrize("method,k", [("none", 1), ("draft", 4), ("draft", 8), ("eagle3", 4), ("eagle3", 8)])
@pytest.mark.parametrize("prompt", [PROMPT, SHORT_PROMPT])
def test_greedy_generation_is_unchanged(decoder, method, k, prompt):
    config = GenerationConfig(method=method, k=k, max_new_tokens=40)
    set_padding(decoder, False)
    want = decoder.generate_ids(prompt, config)
    set_padding(decoder, True)
    rows = record_rows(decoder.target)
    try:
        got = decoder.generate_ids(prompt, config)
    finally:
        del decoder.target.block_step  # the class's method again
        set_padding(decoder, False)
    assert got == want and len(got) == 40
    assert rows[0] == (64 if prompt == PROMPT else 32)  # the prefill ran padded
    if k == 8:
        assert 16 in rows  # verification blocks of 9 ran padded too
