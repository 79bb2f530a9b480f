"""The published heads' layer (engine.methods.public_heads.HeadLayer) offers the runner API of a captured
draft chain: its block_step (start on the device, a bucketed attention width) equals its eager forward_embeds,
a chain and a tree; EAGLE's chain steps (what engine.methods.eagle.graphs.eagle_chain captures) draft the
eager chain's tokens; and with the graph machinery on (replayed eagerly here: the CPU captures nothing) every
path of the drafter runs and stays lossless."""
import pytest
import torch
from test_public_heads import HEADS as ATTENTION_HEADS
from test_public_heads import HIDDEN, KV_HEADS, LAYERS, PROMPT, VOCAB, decoder_with, make_eagle1, make_eagle3
from tiny_models import make_tiny_llama

from engine.analysis.lossless import check_greedy
from engine.config import GenerationConfig
from engine.core.graphs import ChainGraphs
from engine.methods.base import DecodeState
from engine.methods.eagle import drafter as eagle_drafter
from engine.methods.eagle import graphs as eagle_graphs
from engine.methods.eagle.drafter import EagleDrafter
from engine.methods.eagle.graphs import eagle_chain_steps
from engine.models.runner import tree_ancestor_mask, tree_depths

HEADS = {"eagle1": ("eagle", lambda d: make_eagle1(d)), "eagle3": ("eagle3", lambda d: make_eagle3(d))}
TOKENS = [5, 9, 14, 3, 22, 9, 30, 7, 11, 2, 19, 4]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("public_graphs")
    return make_tiny_llama(root / "target", vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, heads=ATTENTION_HEADS,
                           kv_heads=KV_HEADS, seed=5, std=0.3)


def head_of(target_dir, folder, name):
    method, make = HEADS[name]
    decoder = decoder_with(target_dir, make(folder / name))
    return decoder, decoder.eagle_head() if method == "eagle" else decoder.eagle3_head()


def head_inputs(decoder, head, ids):
    """The head's inputs [len(ids) - 1, W] for these tokens: the target's features (its taps for EAGLE-3)
    fused with each position's next token."""
    target = decoder.target
    target.reset()
    target.tap_layers = getattr(head, "tap_layers", ())
    out = target.forward(torch.tensor(ids[:-1]))
    features = out.hidden if out.taps is None else out.taps
    return head.fuse(head.true_features(features), torch.tensor(ids[1:]))


def block_step_at(runner, x, start, block, kv):
    depth, visible = block
    return runner.block_step(x, torch.tensor([start]), depth, visible, kv)


@pytest.mark.parametrize("name", sorted(HEADS))
@pytest.mark.parametrize("parents", [None, [-1, 0, 0, 1, -1, 4]])
def test_block_step_equals_forward_embeds(target_dir, tmp_path, name, parents):
    decoder, head = head_of(target_dir, tmp_path, name)
    runner = head.runner
    x = head_inputs(decoder, head, TOKENS)  # [11, W]
    m, n = 5, 6
    runner.reset()
    runner.forward_embeds(x[:m])
    tree = None if parents is None else torch.tensor(parents)
    reference = runner.forward_embeds(x[m:m + n], tree)
    cache = runner.kv[:, :, :m + n].clone()
    block = runner.chain_block(n) if tree is None else (tree_depths(tree), tree_ancestor_mask(tree))
    for kv in (runner.kv_width(m + n), m + n, 0):  # 0: the decode path's whole cache
        runner.rollback(m)
        runner.kv[:, :, m:] = 0  # the block's rows are written again
        hidden, logits = block_step_at(runner, x[m:m + n], m, block, kv)
        assert runner.length == m  # the caller sets the length (a captured chain does, on the host)
        assert torch.allclose(hidden, reference.hidden, atol=1e-5, rtol=1e-5), (kv, hidden - reference.hidden)
        assert torch.allclose(logits, reference.logits, atol=1e-5, rtol=1e-5), kv
        assert logits.dtype == torch.float32 and logits.shape == reference.logits.shape
        assert torch.allclose(runner.kv[:, :, :m + n], cache, atol=1e-6)


def test_kv_width_is_bucketed_and_the_chain_block_kept(target_dir, tmp_path):
    from engine.models.llama import KV_BUCKET

    _, head = head_of(target_dir, tmp_path, "eagle1")
    runner = head.runner
    widths = {runner.kv_width(rows) for rows in range(1, runner.max_length + 1)}
    assert widths == {min(runner.max_length, b) for b in range(KV_BUCKET, runner.max_length + KV_BUCKET,
                                                                KV_BUCKET)}
    assert runner.kv_width(11) > 11  # padded past the rows: the mask hides the rest
    depth, visible = runner.chain_block(4)
    assert runner.chain_block(4)[0] is depth and torch.equal(depth, torch.arange(4))
    assert torch.equal(visible, torch.ones(4, 4, dtype=torch.bool).tril())
    assert runner.decode_path(1) and runner.use_graphs is False and runner.pool_handle is None


def _state(decoder, k):
    config = GenerationConfig(method="eagle", k=k)
    return DecodeState(tokens=list(TOKENS), prompt_len=len(TOKENS), config=config,
                       generator=torch.Generator().manual_seed(0), backend=decoder.backend,
                       vocab_size=decoder.vocab_size, device=decoder.device)


@pytest.mark.parametrize("name", sorted(HEADS))
@pytest.mark.parametrize("k", [2, 5])
def test_chain_steps_draft_the_eager_chain(target_dir, tmp_path, name, k):
    """eagle_chain_steps (what eagle_chain captures, start on the device) drafts the drafter's eager chain."""
    decoder, head = head_of(target_dir, tmp_path, name)
    runner = head.runner
    runner.reset()
    out = runner.forward_embeds(head_inputs(decoder, head, TOKENS))
    feature, logits, m = out.hidden[-1:], out.logits[-1:], runner.length
    eager = EagleDrafter(decoder.target, head)._chain(_state(decoder, k), feature, logits, k, None, None)
    runner.rollback(m)
    tokens, q = eagle_chain_steps(head, feature, torch.tensor([m]), k, runner.kv_width(m + k),
                                  decoder.vocab_size, None, torch.zeros(k), logits)
    assert q is None and tokens.tolist() == eager.tokens.tolist()


class EagerChain:
    """engine.core.graphs.CapturedChain's contract without CUDA: the warm-up run at build, then each run
    copies its inputs into the static buffers and runs fn over them."""

    def __init__(self, fn, inputs, device, pool):
        self.fn, self.inputs = fn, inputs
        fn(*inputs)  # the warm-up writes rows after the cache's end, as the capture's does

    def run(self, *values):
        for buffer, value in zip(self.inputs, values):
            if isinstance(value, int):
                buffer.fill_(value)
            elif value is not None:
                buffer.copy_(value)
        out = self.fn(*self.inputs)
        return tuple(None if t is None else t.clone() for t in out) if isinstance(out, tuple) else out.clone()


@pytest.fixture
def chain_graphs_on_cpu(monkeypatch):
    """ChainGraphs applies on the CPU for a runner with use_graphs, and its graphs run eagerly."""
    def available(runner, k, sampling=None):
        return k > 1 and getattr(runner, "use_graphs", False) and hasattr(runner, "block_step")

    monkeypatch.setattr(ChainGraphs, "available", staticmethod(available))
    for module in (eagle_graphs, eagle_drafter):
        monkeypatch.setattr(module, "CapturedChain", EagerChain)
        monkeypatch.setattr(module, "graph_pool", lambda runner: None)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_every_path_runs_with_the_chain_graphs_on(target_dir, tmp_path, chain_graphs_on_cpu, name):
    """With graphs on, the public heads' rounds go through the graph paths (the head's step and chain as
    one graph on the decode path, the chain alone after a long feed, the trees' growth): greedy output
    equals plain decoding on every path."""
    decoder, head = head_of(target_dir, tmp_path, name)
    method = HEADS[name][0]
    head.runner.use_graphs = True
    graphs = ChainGraphs.of(head.runner)
    for nodes in (0, 6):
        for k in (1, 4):
            config = GenerationConfig(method=method, k=k, tree_nodes=nodes, max_new_tokens=24,
                                      stop_at_eos=False)
            report = check_greedy(decoder, PROMPT, config)
            assert report.passed, (name, nodes, k, report)
    kinds = [key[0] for key in graphs._graphs]
    assert "eagle-round" in kinds, kinds  # a chain's round: the head's step and its chain, one graph
    decoder.set_cuda_graphs(False)  # the decoder's switch reaches the head's runner
    assert head.runner.use_graphs is False


@pytest.mark.parametrize("name", sorted(HEADS))
def test_one_row_block_step_equals_forward_embeds(target_dir, tmp_path, name):
    """A chain's step (one row, its own short mask) as forward_embeds computes it, at every width."""
    decoder, head = head_of(target_dir, tmp_path, name)
    runner = head.runner
    x = head_inputs(decoder, head, TOKENS)  # [11, W]
    runner.reset()
    runner.forward_embeds(x[:7])
    reference = runner.forward_embeds(x[7:8])
    for kv in (runner.kv_width(8), 8, 0):
        runner.rollback(7)
        hidden, logits = block_step_at(runner, x[7:8], 7, runner.chain_block(1), kv)
        assert torch.allclose(hidden, reference.hidden, atol=1e-5, rtol=1e-5), kv
        assert torch.allclose(logits, reference.logits, atol=1e-5, rtol=1e-5), kv
