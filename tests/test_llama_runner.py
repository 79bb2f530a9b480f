"""LlamaRunner against transformers' own models (fp32, eager): chains, trees, compaction, rollback."""
from __future__ import annotations

import json

import pytest
import torch

from engine.errors import SpecplayError
from engine.models.llama import LlamaRunner, is_llama_family
from engine.models.runner import tree_ancestor_mask, tree_depths
from tests.tiny_models import load_hf_reference, make_tiny_llama

TOL = 1e-4
VOCAB = 96

VARIANTS = {
    "llama": dict(arch="llama"),
    "llama3-rope-tied": dict(
        arch="llama",
        tie=True,
        rope_theta=500000.0,
        rope={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32},
    ),
    "qwen2": dict(arch="qwen2", seed=3),
    "mistral-linear-rope": dict(arch="mistral", seed=5, rope={"rope_type": "linear", "factor": 2.0}),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_models")
    return {name: make_tiny_llama(root / name, vocab=VOCAB, **kw) for name, kw in VARIANTS.items()}


@pytest.fixture(scope="module")
def references(model_dirs):
    return {name: load_hf_reference(path) for name, path in model_dirs.items()}


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Full no-cache forward of one sequence -> [n, V]."""
    return model(input_ids=tokens[None]).logits[0].float()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chain_blocks_match_transformers(variant, model_dirs, references):
    runner = LlamaRunner.from_pretrained(model_dirs[variant], max_length=64)
    tokens = _tokens(20, seed=1)
    expected = _hf_logits(references[variant], tokens)  # [20, V]
    outputs, pos = [], 0
    for size in (9, 1, 3, 2, 1, 4):  # a prefill, then incremental chain blocks
        outputs.append(runner.forward(tokens[pos : pos + size]))
        pos += size
    assert runner.length == 20
    logits = torch.cat([o.logits for o in outputs])
    assert logits.dtype == torch.float32 and logits.shape == (20, VOCAB)
    assert (logits - expected).abs().max().item() <= TOL
    hidden = torch.cat([o.hidden for o in outputs])  # [20, H], before the final norm
    assert (runner.logits_from_hidden(hidden) - logits).abs().max().item() <= TOL


def test_final_hidden_is_before_the_norm(model_dirs, references):
    runner = LlamaRunner.from_pretrained(model_dirs["llama"], max_length=32)
    tokens = _tokens(6, seed=2)
    hidden = runner.forward(tokens).hidden
    with torch.no_grad():
        states = references["llama"](input_ids=tokens[None], output_hidden_states=True).hidden_states
    # transformers' last entry has the final norm applied; ours is the raw last-layer output.
    normed = references["llama"].model.norm(hidden[None])[0]
    assert (normed - states[-1][0]).abs().max().item() <= TOL


def test_embed_is_the_embedding_table(model_dirs, references):
    runner = LlamaRunner.from_pretrained(model_dirs["qwen2"], max_length=32)
    tokens = _tokens(5, seed=3)
    expected = references["qwen2"].get_input_embeddings()(tokens)
    assert torch.equal(runner.embed(tokens), expected.detach())


# A tree of 9 nodes: two roots (0 and 6), branching below both.
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, -1, 6, 7])


def _path(parents: torch.Tensor, node: int) -> list:
    """Node indices root..node."""
    out = []
    while node >= 0:
        out.append(node)
        node = int(parents[node])
    return out[::-1]


def _fresh_logits(path, prefix: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """A fresh runner's logits of `after`, prefilled with prefix + after in one block."""
    fresh = LlamaRunner.from_pretrained(path, max_length=64)
    return fresh.forward(torch.cat([prefix, after])).logits[-after.numel() :]


def _tree_and_its_chains(path, seeds: tuple) -> tuple:
    """A prompt of 7 tokens, then the tree PARENTS in one block: the length after the tree, the tree's output
    and, node by node, the output of that node's path forwarded as a chain after the prompt (rolled back)."""
    runner = LlamaRunner.from_pretrained(path, max_length=64)
    prompt, tree = _tokens(7, seed=seeds[0]), _tokens(PARENTS.numel(), seed=seeds[1])
    runner.forward(prompt)
    out = runner.forward(tree, PARENTS)
    length, chains = runner.length, []
    for node in range(PARENTS.numel()):
        runner.rollback(7)
        chains.append(runner.forward(tree[_path(PARENTS, node)]))
    return length, out, chains


def _compact_then_forward(path, sizes: tuple, seeds: tuple, node: int) -> tuple:
    """A prompt, the tree PARENTS, compact to the path root..node, then `after`: the length after compact, the
    path's length, and the logits of `after` with those of a fresh prefill of prompt + path + after."""
    (n_prompt, n_after), runner = sizes, LlamaRunner.from_pretrained(path, max_length=64)
    prompt, tree = _tokens(n_prompt, seed=seeds[0]), _tokens(PARENTS.numel(), seed=seeds[1])
    after = _tokens(n_after, seed=seeds[2])
    runner.forward(prompt)
    runner.forward(tree, PARENTS)
    accepted = torch.tensor(_path(PARENTS, node))
    runner.compact(n_prompt, accepted)
    length = runner.length
    got = runner.forward(after).logits
    return length, accepted.numel(), got, _fresh_logits(path, torch.cat([prompt, tree[accepted]]), after)


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_tree_nodes_match_their_paths_as_chains(variant, model_dirs):
    length, out, chains = _tree_and_its_chains(model_dirs[variant], seeds=(4, 5))
    assert length == 7 + PARENTS.numel()
    for node, chain in enumerate(chains):
        assert (out.logits[node] - chain.logits[-1]).abs().max().item() <= TOL, node
        assert (out.hidden[node] - chain.hidden[-1]).abs().max().item() <= TOL, node


def test_compact_after_tree_equals_fresh_prefill(model_dirs):
    length, kept, got, want = _compact_then_forward(model_dirs["mistral-linear-rope"], sizes=(6, 4),
                                                    seeds=(6, 7, 8), node=4)  # nodes 0 -> 1 -> 4
    assert length == 6 + kept
    assert (got - want).abs().max().item() <= TOL


def test_compact_keeps_a_path_with_gaps(model_dirs):
    """The second root's subtree (nodes 6, 7, 8) sits after other nodes: rows move down across a gap."""
    _, _, got, want = _compact_then_forward(model_dirs["llama"], sizes=(5, 3), seeds=(9, 10, 11),
                                            node=8)  # nodes 6 -> 7 -> 8
    assert (got - want).abs().max().item() <= TOL


def test_the_round_graphs_path_keeping_is_the_runners_compact(model_dirs):
    """engine.core.graphs.keep_path (start on the device, in a captured round; the path padded with -1
    to the
    tree's depth) keeps the rows that compact keeps: a path with a gap, then a fresh prefill's logits."""
    from engine.core.graphs import keep_path

    path = model_dirs["llama"]
    runner = LlamaRunner.from_pretrained(path, max_length=64)
    prompt, tree, after = _tokens(6, seed=21), _tokens(PARENTS.numel(), seed=22), _tokens(3, seed=23)
    runner.forward(prompt[:5])
    block_parents = torch.cat([torch.tensor([-1]), PARENTS + 1])  # row 0: the last committed token
    runner.forward(torch.cat([prompt[5:], tree]), block_parents)
    accepted = _path(PARENTS, 8)  # nodes 6 -> 7 -> 8
    keep_path(runner, torch.tensor([5]), torch.tensor(accepted + [-1]), torch.arange(4))
    runner.rollback(5 + 1 + len(accepted))
    got = runner.forward(after).logits
    want = _fresh_logits(path, torch.cat([prompt, tree[torch.tensor(accepted)]]), after)
    assert (got - want).abs().max().item() <= TOL


def test_rollback_then_forward_equals_fresh_prefill(model_dirs):
    path = model_dirs["qwen2"]
    runner = LlamaRunner.from_pretrained(path, max_length=64)
    seq, wrong, right = _tokens(10, seed=12), _tokens(5, seed=13), _tokens(4, seed=14)
    runner.forward(seq)
    runner.forward(wrong)
    runner.rollback(8)
    got = runner.forward(right).logits
    assert (got - _fresh_logits(path, seq[:8], right)).abs().max().item() <= TOL  # right: 4 tokens


def test_reset_gives_fresh_results(model_dirs):
    runner = LlamaRunner.from_pretrained(model_dirs["llama"], max_length=32)
    a, b = _tokens(8, seed=15), _tokens(8, seed=16)
    first = runner.forward(a).logits
    runner.forward(b)
    runner.reset()
    assert torch.allclose(runner.forward(a).logits, first, atol=TOL)


def test_exceeding_max_length_raises(model_dirs):
    runner = LlamaRunner.from_pretrained(model_dirs["llama"], max_length=12)
    runner.forward(_tokens(10, seed=17))
    with pytest.raises(SpecplayError, match="max_length 12"):
        runner.forward(_tokens(3, seed=18))
    assert runner.length == 10  # the failed call changed nothing
    runner.forward(_tokens(2, seed=19))
    assert runner.length == 12


def test_sharded_checkpoint_loads(model_dirs, references, tmp_path):
    references["llama"].save_pretrained(str(tmp_path), max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    runner = LlamaRunner.from_pretrained(tmp_path, max_length=16)
    tokens = _tokens(8, seed=20)
    assert (runner.forward(tokens).logits - _hf_logits(references["llama"], tokens)).abs().max() <= TOL


# Sliding windows shorter than the sequences below, so the window hides rows in every test.
WINDOWED = {
    "mistral-window": ("mistral", dict(sliding_window=5)),
    # Qwen2 windows only layers from max_window_layers on: layer 0 full, layer 1 windowed
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1,
                                   layer_types=None)),
}


def set_config(path, **fields):
    """Edit config.json in place; a None value removes the field."""
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for key, value in fields.items():
        cfg.pop(key, None) if value is None else cfg.__setitem__(key, value)
    cfg_path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def windowed_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("windowed")
    return {name: set_config(make_tiny_llama(root / name, arch=arch, vocab=VOCAB, seed=7), **fields)
            for name, (arch, fields) in WINDOWED.items()}


@pytest.mark.parametrize("variant", list(WINDOWED))
def test_sliding_window_chain_blocks_match_transformers(variant, windowed_dirs):
    runner = LlamaRunner.from_pretrained(windowed_dirs[variant], max_length=64)
    assert runner.max_length == 64 and runner._window is not None  # the cache is not clamped to the window
    reference = load_hf_reference(windowed_dirs[variant])
    tokens = _tokens(24, seed=21)
    expected = _hf_logits(reference, tokens)  # [24, V]
    logits = torch.cat([runner.forward(tokens[a:b]).logits for a, b in [(0, 9), (9, 10), (10, 13), (13, 24)]])
    assert (logits - expected).abs().max().item() <= TOL
    # the window really hides rows: full attention gives other logits
    runner.reset()
    runner._window = None
    assert (runner.forward(tokens).logits - expected).abs().max().item() > 1e-2


@pytest.mark.parametrize("variant", list(WINDOWED))
def test_sliding_window_tree_nodes_match_their_paths(variant, windowed_dirs):
    _, out, chains = _tree_and_its_chains(windowed_dirs[variant], seeds=(22, 23))
    for node, chain in enumerate(chains):
        assert (out.logits[node] - chain.logits[-1]).abs().max().item() <= TOL, node


def test_sliding_window_compact_equals_fresh_prefill(windowed_dirs):
    _, _, got, want = _compact_then_forward(windowed_dirs["mistral-window"], sizes=(6, 6), seeds=(24, 25, 26),
                                            node=8)  # nodes 6 -> 7 -> 8, moved down across a gap
    assert (got - want).abs().max().item() <= TOL


def test_window_longer_than_the_cache_runs_full_attention(tmp_path):
    path = set_config(make_tiny_llama(tmp_path / "m", arch="mistral", tokenizer=False), sliding_window=16)
    assert LlamaRunner.from_pretrained(path).max_length == 256  # max_position_embeddings, not the window
    assert LlamaRunner.from_pretrained(path, max_length=16)._window is None  # nothing to hide
    assert LlamaRunner.from_pretrained(path, max_length=17)._window == 16


def test_sliding_window_follows_transformers_config_rules():
    from engine.models.llama import _sliding_window

    assert _sliding_window({"model_type": "llama", "sliding_window": 8}, 2) == (None, (False, False))
    assert _sliding_window({"model_type": "mistral"}, 2) == (4096, (True, True))  # transformers' default
    assert _sliding_window({"model_type": "mistral", "sliding_window": None}, 2) == (None, (False, False))
    qwen = {"model_type": "qwen2", "sliding_window": 8, "max_window_layers": 1}
    assert _sliding_window(qwen, 3) == (None, (False,) * 3)  # use_sliding_window off
    assert _sliding_window({**qwen, "use_sliding_window": True}, 3) == (8, (False, True, True))
    types = ["sliding_attention", "full_attention", "full_attention"]
    typed = {**qwen, "use_sliding_window": True, "layer_types": types}
    assert _sliding_window(typed, 3) == (8, (True, False, False))
    # another depth than config.json's (an EAGLE head copies its target's config): the max_window_layers rule
    assert _sliding_window({**typed, "layer_types": types[:2]}, 3) == (8, (False, True, True))


def test_is_llama_family():
    assert is_llama_family({"model_type": "qwen2"})
    assert not is_llama_family({"model_type": "gpt2"})

    class Cfg:
        model_type = "mistral"

    assert is_llama_family(Cfg())


@pytest.mark.parametrize("parents", [None, [-1, 0, 0, 1, 2]], ids=["chain", "tree"])
def test_padded_attention_width_changes_nothing(model_dirs, parents):
    """A captured CUDA step attends over a bucket of cache rows wider than the cache; the mask must hide every
    row past the block, including stale rows an earlier, longer block left there."""
    runner = LlamaRunner.from_pretrained(model_dirs["llama"], max_length=64)
    runner.forward(_tokens(20, seed=2))
    runner.rollback(7)  # rows 7..19 now stale; the block writes 7..11 and 12..19 stay stale
    x = runner.embed(_tokens(5, seed=4))  # [5, H]
    if parents is None:
        depth, visible = runner.chain_block(5)
    else:
        tree = torch.tensor(parents)
        depth, visible = tree_depths(tree), tree_ancestor_mask(tree)
    start = torch.tensor([7])
    exact_hidden, exact_logits = runner.block_step(x, start, depth, visible, kv=12)
    padded_hidden, padded_logits = runner.block_step(x, start, depth, visible, kv=48)
    assert torch.allclose(exact_hidden, padded_hidden, atol=1e-5)
    assert torch.allclose(exact_logits, padded_logits, atol=1e-5)
    out = runner.forward(_tokens(5, seed=4), None if parents is None else torch.tensor(parents))
    assert torch.allclose(out.logits, exact_logits, atol=1e-5)
