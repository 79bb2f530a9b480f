"""Medusa, EAGLE and lookahead: tree drafts verified in one forward, lossless (greedy and chi-squared)."""
import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import make_tiny_llama

from engine.analysis.lossless import check_sampling
from engine.config import GenerationConfig, SamplingParams
from engine.core.decoder import SpeculativeDecoder
from engine.methods.medusa.drafter import assumed_chances, default_choices, medusa_tree
from engine.methods.tree import build_trie
from engine.models.loading import load_pair

PROMPT = "the cat sat on the mat. the cat sat on the"


def add_random_medusa_heads(model_dir, hidden: int, heads: int = 4, seed: int = 0, layers: int = 2,
                            int8: bool = True):
    """Random Medusa heads beside a model, by default as the shipped ones are: two blocks a head, the
    matrices int8 with a scale a row."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for block in ("heads", "second")[:layers]:
        for i in range(heads):
            weight = 0.2 * torch.randn(hidden, hidden, generator=gen)
            tensors[f"{block}.{i}.bias"] = 0.1 * torch.randn(hidden, generator=gen)
            if int8:
                scale = weight.abs().amax(1) / 127
                tensors[f"{block}.{i}.weight"] = (weight / scale[:, None]).round().to(torch.int8)
                tensors[f"{block}.{i}.weight_scale"] = scale.half()
            else:
                tensors[f"{block}.{i}.weight"] = weight
    save_file(tensors, str(model_dir / "medusa_heads.safetensors"))
    (model_dir / "medusa_config.json").write_text(json.dumps({"num_heads": heads, "hidden_size": hidden,
                                                              "layers": layers, "offsets": [2, 3, 4, 5]}))


def add_random_eagle_head(model_dir, hidden: int, heads: int = 4, kv_heads: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads
    inter = 2 * hidden
    shapes = {
        "fc.weight": (hidden, 2 * hidden),
        "layer.self_attn.q_proj.weight": (heads * head_dim, hidden),
        "layer.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "layer.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        "layer.self_attn.o_proj.weight": (hidden, heads * head_dim),
        "layer.mlp.gate_proj.weight": (inter, hidden),
        "layer.mlp.up_proj.weight": (inter, hidden),
        "layer.mlp.down_proj.weight": (hidden, inter),
    }
    tensors = {name: 0.15 * torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    tensors["layer.input_layernorm.weight"] = torch.ones(hidden)
    tensors["layer.post_attention_layernorm.weight"] = torch.ones(hidden)
    save_file(tensors, str(model_dir / "eagle_head.safetensors"))
    (model_dir / "eagle_config.json").write_text(json.dumps({
        "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "intermediate_size": inter, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "head_dim": head_dim}))


def add_random_eagle3_head(model_dir, hidden: int, taps=(0, 1), heads: int = 4, kv_heads: int = 2,
                           seed: int = 3):
    """An EAGLE-3 head: the EAGLE head's layout plus proj [H, taps * H] and the tap layers in its config."""
    add_random_eagle_head(model_dir, hidden, heads, kv_heads, seed)
    from safetensors.torch import load_file

    tensors = load_file(str(model_dir / "eagle_head.safetensors"))
    gen = torch.Generator().manual_seed(seed + 1)
    tensors["proj.weight"] = 0.15 * torch.randn(hidden, len(taps) * hidden, generator=gen)
    save_file(tensors, str(model_dir / "eagle3_head.safetensors"))
    config = json.loads((model_dir / "eagle_config.json").read_text())
    (model_dir / "eagle3_config.json").write_text(json.dumps(dict(config, tap_layers=list(taps))))
    add_random_eagle_head(model_dir, hidden, heads, kv_heads, seed=0)  # the EAGLE head as the fixture had it


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    target = make_tiny_llama(root / "target", hidden=64, layers=2, seed=0)
    add_random_medusa_heads(target, 64)
    add_random_eagle_head(target, 64)
    add_random_eagle3_head(target, 64)
    return SpeculativeDecoder(load_pair(str(target), None, device="cpu", need_draft=False))


def test_build_trie_merges_prefixes():
    tokens, parents = build_trie([[5, 6, 7], [5, 6, 8], [9], [5]])
    assert tokens == [5, 6, 7, 8, 9]
    assert parents == [-1, 0, 1, 1, -1]


def test_medusa_default_choices_are_prefix_closed():
    choices = default_choices(8, assumed_chances(4))
    assert len(choices) == 8 and choices[0] == (0,)
    assert all(len(c) == 1 or c[:-1] in choices for c in choices)


def random_path_chances(generator, heads=2, ranks=3):
    """Chances of paths that are right all the way (a child never more likely than its parent)."""
    chances = {}
    depths = range(1, heads + 1)
    for path in itertools.chain.from_iterable(itertools.product(range(ranks), repeat=d) for d in depths):
        parent = chances.get(path[:-1], 1.0)
        chances[path] = parent * float(torch.rand(1, generator=generator)) * 0.6
    return tuple(chances.items())


def test_medusa_tree_maximises_the_expected_accepted_drafts():
    """The expected number of accepted drafts is the sum of the tree's path chances (siblings differ, so at
    most one is right): check the chosen tree against every prefix-closed tree of 4 nodes (brute force)."""
    generator = torch.Generator().manual_seed(7)
    for _ in range(10):
        chances = random_path_chances(generator)
        table = dict(chances)
        closed = [tree for tree in itertools.combinations(table, 4)
                  if all(len(c) == 1 or c[:-1] in tree for c in tree)]
        best = max(sum(table[c] for c in tree) for tree in closed)
        assert sum(table[c] for c in default_choices(4, chances)) == pytest.approx(best)


def test_measured_path_chances_change_the_medusa_tree():
    """Measured heads whose first guesses are often right together grow a deep tree; assumed ones a bushy
    one."""
    deep = (((0,), 0.3), ((1,), 0.08), ((0, 0), 0.2), ((0, 0, 0), 0.15), ((0, 0, 0, 0), 0.1), ((2,), 0.05))
    assert default_choices(4, deep) == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
    assert default_choices(4, assumed_chances(4)) == ((0,), (0, 0), (1,), (0, 0, 0))


@pytest.mark.parametrize("nodes, depth", [(8, 4), (16, 4), (3, 2), (1, 1), (64, 4)])
def test_medusa_tree_is_the_trie_of_its_paths(nodes, depth):
    """Medusa's tree is built once per choice set and its tokens gathered on the device; it must be exactly
    the trie of the candidate paths for any ranking of the heads."""
    tree = medusa_tree(nodes, assumed_chances(depth))
    choices = default_choices(nodes, assumed_chances(depth))
    generator = torch.Generator().manual_seed(nodes * 10 + depth)
    for _ in range(20):
        # each head's top ranks are distinct tokens; different heads may share tokens
        ranked = torch.stack([torch.randperm(12, generator=generator)[:tree.width] for _ in range(depth)])
        tokens, parents = build_trie([[int(ranked[d, r]) for d, r in enumerate(choice)]
                                      for choice in choices])
        assert ranked.flatten()[list(tree.flat_index)].tolist() == tokens
        assert list(tree.parents) == parents


TREE_METHODS = ["medusa", "medusa-fixed", "lookahead", "eagle:8", "eagle3:8"]
ALL_NEW = TREE_METHODS + ["eagle", "eagle3"]


def config_for(spec, **kw):
    """'eagle:8' is EAGLE with a dynamic tree of 8 nodes; 'eagle' a chain of K."""
    return GenerationConfig(**kw).with_spec(spec)


@pytest.mark.parametrize("method", ALL_NEW)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_tree_methods_greedy_equal_plain(decoder, method, k):
    plain = decoder.generate_ids(PROMPT, GenerationConfig(method="none", max_new_tokens=40))
    spec = decoder.generate_ids(PROMPT, config_for(method, k=k, max_new_tokens=40))
    assert spec == plain


@pytest.mark.parametrize("method", TREE_METHODS)
def test_tree_rounds_are_trees(decoder, method):
    events = list(decoder.generate(PROMPT, config_for(method, k=3, max_new_tokens=40)))
    sizes = [len(e.drafted) for e in events]
    assert max(sizes) > 3, "expected branching trees larger than the chain depth"
    for e in events:
        accepted = [t for t in e.drafted if t.accepted]
        assert len(accepted) == e.accepted_count
        # the accepted nodes form one root-to-node path
        for depth, token in enumerate(sorted(accepted, key=lambda t: t.depth)):
            assert token.depth == depth


def test_medusa_fixed_drafts_one_tree_and_medusa_chooses_its_tree_per_round(decoder):
    """`medusa-fixed` drafts the same tree shape every round (Medusa's original tree); `medusa` chooses the
    shape per round from its heads' scores, so its shapes differ between rounds."""
    def shapes(spec):
        events = decoder.generate(PROMPT, config_for(spec, k=4, max_new_tokens=60))
        return {tuple(t.parent for t in e.drafted) for e in events if e.drafted}

    assert len(shapes("medusa-fixed")) == 1
    assert len(shapes("medusa")) > 1


@pytest.mark.slow  # a statistical or end-to-end check: `make test-fast` skips it
@pytest.mark.parametrize("method", ALL_NEW)
def test_tree_methods_sampling_is_lossless(tmp_path_factory, method):
    root = tmp_path_factory.mktemp(f"chi_{method}")
    target = make_tiny_llama(root / "target", vocab=24, hidden=32, layers=1, seed=11, std=0.3)
    add_random_medusa_heads(target, 32)
    add_random_eagle_head(target, 32)
    add_random_eagle3_head(target, 32, taps=(0,))
    decoder = SpeculativeDecoder(load_pair(str(target), None, device="cpu", need_draft=False))
    config = config_for(method, k=3, sampling=SamplingParams(0.8, 0, 0.9), seed=500)
    report = check_sampling(decoder, "a tea at the tea at", config, samples=800)
    assert report.bins >= 8 and report.passed, report


@pytest.mark.parametrize("method", ["none", "ngram"] + ALL_NEW)
def test_the_next_tokens_figures_come_from_the_row_that_gave_it(decoder, method):
    """Greedy: the next token is the top alternative of the block row after the accepted path (row 0 when
    nothing was accepted), so its p is that row's largest; a tree's path is node indices, the row node + 1."""
    events = list(decoder.generate(PROMPT, config_for(method, k=3, max_new_tokens=40)))
    if method in ("ngram", "lookahead"):  # the repeating prompt gets them accepted drafts (rows past 0)
        assert any(e.accepted_count for e in events)
    for e in events:
        top_text, top_p = e.next_top[0]
        assert top_text == e.next_token_text and e.next_token_p == pytest.approx(top_p)


@pytest.mark.parametrize("head_name", ["eagle", "eagle3"])
@pytest.mark.parametrize("n, k", [(1, 3), (4, 3), (2, 5)])
def test_eagle_round_body_equals_the_heads_step_then_its_chain(decoder, head_name, n, k):
    """EAGLE's round graph (engine.core.graphs.eagle_round_body) does what the eager path does: the
    head's
    step over the n committed positions, then a greedy chain of k from its last predicted feature; here run
    eagerly on the CPU."""
    import torch

    from engine.methods.eagle.graphs import eagle_round_body

    head = decoder.eagle_head() if head_name == "eagle" else decoder.eagle3_head()
    runner = head.runner
    width = head.proj.shape[1] if head_name == "eagle3" else runner.spec.hidden_size
    gen = torch.Generator().manual_seed(n * 10 + k)
    features = torch.randn(n, width, generator=gen)  # the target's raw features
    tokens = torch.randint(0, decoder.vocab_size, (n,), generator=gen)
    vocab = decoder.vocab_size

    runner.reset()
    feature = head.step(head.true_features(features), tokens)[-1:]
    logits, expected = head.logits(feature), []
    for i in range(k):
        expected.append(int(logits[:, :vocab].argmax(-1)))
        if i < k - 1:
            out = runner.forward_embeds(head.fuse(feature, torch.tensor(expected[-1:])))
            feature, logits = out.hidden[-1:], out.logits[-1:]

    runner.reset()
    start = torch.zeros(1, dtype=torch.long)
    kv = runner.kv_width(n + k)
    drafted, q = eagle_round_body(head, features, tokens, start, k, kv, vocab, None, None)
    assert drafted.tolist() == expected and q is None  # the chain's steps read the rows the feed wrote


def test_a_failed_graph_capture_is_retried_once_then_drafting_goes_without_it(caplog):
    """A capture invalidated by an earlier operation (seen now and then on an H200) is tried again in a new
    memory pool (the failed capture's pool is dropped); failing twice, the caller gets None and drafts without
    the graph, with a warning, rather than crashing the run."""
    from engine.core.graphs import ChainGraphs

    runner = type("Runner", (), {"pool_handle": "pool 1"})()
    graphs, calls = ChainGraphs(runner), []

    def flaky(fails: int):
        def build():
            calls.append(1)
            if len(calls) <= fails:
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
            return "graph"
        return build

    assert graphs.get(("eagle-round", 1), flaky(1)) == "graph" and len(calls) == 2
    assert runner.pool_handle is None  # the next capture takes a new pool
    assert graphs.get(("eagle-round", 1), flaky(0)) == "graph" and len(calls) == 2  # kept, not rebuilt
    calls.clear()
    assert graphs.get(("eagle-round", 2), flaky(5)) is None and len(calls) == 2
    assert len(graphs) == 1 and "attempt 2 of 2" in caplog.text


def _host_choice(scores: list, parents: list, nodes: int) -> tuple:
    """The tree the device choice must equal: the `nodes` best by score (shallower first on ties), closed
    under ancestors, in level order, parents renumbered."""
    depth = []
    for parent in parents:
        depth.append(0 if parent < 0 else depth[parent] + 1)
    best = sorted(range(len(scores)), key=lambda i: (-scores[i], depth[i]))[:nodes]
    keep = sorted(best)
    slot = {old: new for new, old in enumerate(keep)}
    return keep, [slot[parents[i]] if parents[i] >= 0 else -1 for i in keep]


@pytest.mark.parametrize("seed", range(6))
def test_the_trees_nodes_are_chosen_on_the_device_as_on_the_host(seed):
    """EAGLE's tree keeps its best nodes without a host copy (engine.methods.eagle.drafter.choose_nodes): the
    same
    nodes and parents as choosing them on the host, exactly `nodes` of them closed under ancestors even when a
    child's log-probability is 0 (its score ties its parent's), and the block's depths and visibility equal
    those the runner derives from the parents."""
    from engine.methods.eagle.drafter import choose_nodes
    from engine.models.runner import tree_ancestor_mask, tree_depths

    gen = torch.Generator().manual_seed(seed)
    total, nodes = 15, 8
    parents = [-1, -1, -1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(3, total)]
    logp = -torch.rand(total, generator=gen) * 3
    logp[torch.randperm(total, generator=gen)[:4]] = 0.0  # sure children: a score equal to the parent's
    scores = []
    for i, parent in enumerate(parents):
        scores.append(float(logp[i]) + (0.0 if parent < 0 else scores[parent]))
    parents_t = torch.tensor(parents)
    ancestors, depth = tree_ancestor_mask(parents_t), tree_depths(parents_t)
    tokens = torch.arange(100, 100 + total)
    got_tokens, got_parents, block_depth, block_visible = choose_nodes(
        tokens, parents_t, torch.tensor(scores), depth, ancestors, nodes)
    keep, want_parents = _host_choice(scores, parents, nodes)
    assert got_tokens.tolist() == [100 + i for i in keep]
    assert got_parents.tolist() == want_parents
    block_parents = torch.tensor([-1] + [p + 1 for p in want_parents])
    assert block_depth.tolist() == tree_depths(block_parents).tolist()
    assert torch.equal(block_visible, tree_ancestor_mask(block_parents))


def test_feed_length_captures_cover_one_to_k_plus_one_and_respect_the_cache_end():
    """engine.core.graphs.capture_feed_lengths (behind prepare_draft_rounds, prepare_eagle_rounds and
    prepare_tree_rounds): every feed length 1..K+1 is asked for, those that exist are counted, and nothing is
    captured when the warm-ups' rows would run past the cache."""
    from engine.core.graphs import capture_feed_lengths

    runner = type("Runner", (), {"length": 10, "max_length": 30})()
    asked = []

    def graph_of(n):
        asked.append(n)
        return None if n == 2 else f"graph {n}"

    assert capture_feed_lengths(runner, 4, 9, graph_of) == 4 and asked == [1, 2, 3, 4, 5]
    asked.clear()
    assert capture_feed_lengths(runner, 4, 21, graph_of) == 0 and asked == []


def fixed_tree_drafter(target, heads):
    """A Medusa drafter of the fixed tree (the method medusa-fixed's)."""
    from engine.methods.medusa.drafter import MedusaDrafter

    drafter = MedusaDrafter(target, heads)
    drafter.dynamic = False
    return drafter


def test_medusa_rows_draft_what_each_row_drafts_alone(decoder):
    """medusa_draft_rows (every row of a block, the heads stacked into one product) gives row i the tree that
    the one-row proposal drafts from row i's feature."""
    from engine.methods.medusa.graphs import medusa_draft_rows

    heads = decoder.medusa_heads()
    drafter = fixed_tree_drafter(decoder.target, heads)
    tree, _ = drafter._tree(*drafter._shape(4))
    flat_index = list(tree.flat_index)
    features = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))  # [M, H]
    rows = medusa_draft_rows(decoder.target, heads, features, tree, decoder.vocab_size)
    assert rows.shape == (5, len(tree.parents))
    for i in range(5):
        logits = heads.logits(decoder.target, features[i])[:tree.depth, :decoder.vocab_size]  # [depth, V]
        alone = torch.topk(logits, tree.width, dim=-1).indices.flatten()[flat_index]
        assert rows[i].tolist() == alone.tolist()


def test_medusa_rows_pick_the_accepted_row_on_the_device(decoder):
    """With a verification's accepted count and path, medusa_rows drafts from the one row that gave the next
    token (0 when nothing was accepted, else the path's last node's row): that row of the every-row draft."""
    from engine.methods.medusa.graphs import medusa_rows

    heads = decoder.medusa_heads()
    drafter = fixed_tree_drafter(decoder.target, heads)
    tree, _ = drafter._tree(*drafter._shape(4))
    features = torch.randn(6, 64, generator=torch.Generator().manual_seed(5))  # [N+1, H]
    every = medusa_rows(decoder.target, heads, features, tree, decoder.vocab_size)  # [6, N]
    path = torch.tensor([2, 4, 0, -1, -1])
    for accepted, row in ((0, 0), (1, 3), (2, 5), (3, 1)):
        picked = medusa_rows(decoder.target, heads, features, tree, decoder.vocab_size,
                             torch.tensor([accepted]), path)
        assert picked.tolist() == every[row:row + 1].tolist(), accepted


def test_medusa_candidates_are_scored_by_their_heads_log_probabilities(decoder):
    """The dynamic tree's candidates from every row of a block: each path's token is its last head's rank-r
    token and its score the sum of its heads' log-probabilities of its ranks, as computed from that row alone;
    with an accepted count and path, the one row that gave the next token."""
    from engine.methods.medusa.drafter import MedusaCandidates, MedusaDrafter
    from engine.methods.medusa.graphs import medusa_candidate_rows, medusa_draft_rows

    heads = decoder.medusa_heads()
    drafter = MedusaDrafter(decoder.target, heads)
    candidates, _ = drafter._tree(*drafter._shape(4))
    assert isinstance(candidates, MedusaCandidates) and candidates.nodes == 8 < len(candidates.paths)
    features = torch.randn(6, 64, generator=torch.Generator().manual_seed(6))  # [N+1, H]
    tokens, scores = medusa_draft_rows(decoder.target, heads, features, candidates, decoder.vocab_size)
    assert tokens.shape == scores.shape == (6, len(candidates.paths))
    for i in range(6):
        logits = heads.logits(decoder.target, features[i])[:candidates.depth, :decoder.vocab_size].float()
        log_p = logits.log_softmax(-1)  # [depth, V]
        ranked = torch.topk(logits, candidates.width, dim=-1).indices  # [depth, width]
        for j, path in enumerate(candidates.paths):
            assert tokens[i, j] == ranked[len(path) - 1, path[-1]]
            want = sum(log_p[d, ranked[d, r]].item() for d, r in enumerate(path))
            assert abs(scores[i, j].item() - want) < 1e-4, (i, path)
    path = torch.tensor([2, 4, 0, -1, -1, -1, -1, -1])
    picked = medusa_candidate_rows(decoder.target, heads, features, candidates, decoder.vocab_size,
                                   torch.tensor([2]), path)
    assert torch.equal(picked[0], tokens[5:6]) and torch.allclose(picked[1], scores[5:6])


def test_medusa_candidate_rows_on_the_kernels_branch_equal_the_torch_branch(decoder, monkeypatch):
    """The decode kernels' branch of medusa_candidate_rows (sp_topk ranking the log-probabilities and taking
    the candidates' tokens, here its twin) gives the torch branch's tokens and scores, from every row and from
    the accepted row alone, and writes the scores into scores_out."""
    import engine.methods.medusa.graphs as medusa_graphs
    from engine.kernels.step import TopK, topk_reference
    from engine.methods.medusa.drafter import MedusaDrafter
    from engine.methods.medusa.graphs import medusa_candidate_rows

    class TwinKernels:
        calls = 0

        def topk_and_take(self, x, k, index, chained=False):
            TwinKernels.calls += 1
            values, indices = topk_reference(x, k)
            return TopK(values, indices), indices.take(index)

    heads = decoder.medusa_heads()
    drafter = MedusaDrafter(decoder.target, heads)
    candidates, _ = drafter._tree(*drafter._shape(4))
    features = torch.randn(6, 64, generator=torch.Generator().manual_seed(8))  # [N+1, H]
    picks = [(None, None), (torch.tensor([2]), torch.tensor([2, 4, 0, -1, -1, -1, -1, -1]))]
    torch_branch = [medusa_candidate_rows(decoder.target, heads, features, candidates, decoder.vocab_size,
                                          *pick) for pick in picks]
    logits_of = medusa_graphs._medusa_logits
    monkeypatch.setattr(medusa_graphs, "_medusa_logits",
                        lambda *args: (*logits_of(*args)[:2], TwinKernels()))
    for pick, (tokens, scores) in zip(picks, torch_branch):
        out = torch.full(scores.shape, float("nan"))
        kernel_tokens, kernel_scores = medusa_candidate_rows(decoder.target, heads, features, candidates,
                                                             decoder.vocab_size, *pick, scores_out=out)
        assert torch.equal(kernel_tokens, tokens)
        assert kernel_scores.data_ptr() == out.data_ptr() and torch.allclose(out, scores)
    assert TwinKernels.calls == len(picks)


def test_medusa_candidates_tokens_taken_by_the_ranking_launch_are_the_selected_ones():
    """On the decode kernels the candidates' tokens come from the ranking's launch (sp_topk taking them at
    _medusa_index's flat positions in its head-major [depth * M, width] indices); elsewhere they are selected
    from the ranks laid out per row. Both give each row's candidates the same tokens."""
    from engine.methods.medusa.drafter import assumed_chances, medusa_candidates
    from engine.methods.medusa.graphs import _medusa_index

    candidates = medusa_candidates(8, assumed_chances(4))
    depth, width = candidates.depth, candidates.width
    generator = torch.Generator().manual_seed(3)
    for rows in (1, 5):
        ranked = torch.randint(0, 1000, (depth * rows, width), generator=generator)  # head-major
        per_row = ranked.view(depth, rows, width).transpose(0, 1).reshape(rows, depth * width)
        selected = per_row.index_select(1, candidates.tables(ranked.device).last_step)  # [M, T]
        taken = ranked.take(_medusa_index(candidates, rows, ranked.device))  # [M, T]
        assert taken.shape == (rows, len(candidates.paths))
        assert torch.equal(taken, selected), rows
        for m in range(rows):  # each candidate's token: its last head's rank, from row m
            assert taken[m].tolist() == [ranked[(len(p) - 1) * rows + m, p[-1]].item()
                                         for p in candidates.paths]


def test_medusa_chooses_the_best_scored_paths_as_a_tree():
    """MedusaCandidates.choose keeps the `nodes` candidates of the highest scores (ties to the shallower),
    every kept path's prefixes with it, and gives their parents in the tree and the verification block's
    mask."""
    from engine.methods.medusa.drafter import assumed_chances, medusa_candidates
    from engine.models.runner import tree_ancestor_mask

    candidates = medusa_candidates(8, assumed_chances(4))
    count = len(candidates.paths)
    generator = torch.Generator().manual_seed(7)
    for trial in range(20):
        step = -torch.rand(4, candidates.width, generator=generator) * 3  # a head's log-probability a rank
        scores = torch.tensor([sum(step[d, r].item() for d, r in enumerate(p)) for p in candidates.paths])
        tokens = torch.arange(100, 100 + count)
        chosen, parents, depth, visible = candidates.choose(tokens, scores)
        kept = [candidates.paths[t - 100] for t in chosen.tolist()]
        keys = sorted(range(count), key=lambda i: (-scores[i].item(), len(candidates.paths[i])))
        assert set(kept) == {candidates.paths[i] for i in keys[:8]}, trial
        assert all(len(p) == 1 or p[:-1] in kept for p in kept)
        assert parents.tolist() == [kept.index(p[:-1]) if len(p) > 1 else -1 for p in kept]
        block_parents = torch.tensor([-1] + [q + 1 for q in parents.tolist()])
        assert torch.equal(visible, tree_ancestor_mask(block_parents))
        assert depth.tolist() == [0] + [len(p) for p in kept]


def test_medusa_first_round_drafts_from_the_prompts_features(decoder):
    """The prefill's last feature (the one before the prompt's last token) drafts the first round's tree."""
    config = GenerationConfig(method="medusa", k=4, max_new_tokens=8)
    first = next(iter(decoder.generate(PROMPT, config)))
    assert len(first.drafted) == 8


@pytest.mark.parametrize("method", ["medusa", "medusa-fixed"])
def test_medusa_greedy_equals_plain_with_either_tree(decoder, method):
    """Medusa's greedy output is plain decoding's with the tree chosen each round and with the fixed tree
    (medusa-fixed), at K = 2 and 4 and a tree of 16 nodes."""
    plain = decoder.generate_ids(PROMPT, GenerationConfig(method="none", max_new_tokens=40))
    for k, nodes in ((2, 0), (4, 0), (4, 16)):
        config = GenerationConfig(method=method, k=k, max_new_tokens=40, tree_nodes=nodes)
        assert decoder.generate_ids(PROMPT, config) == plain, (k, nodes)


def test_medusa_drafted_behind_the_verification_is_lossless(decoder, monkeypatch):
    """With the rounds pipelined (as on the GPU), Medusa drafts from every block row behind the verification
    (Drafter.verified) and the next round takes the accepted row's tree: the rounds are the one-row path's
    rounds, and greedy output is plain decoding's."""
    config = GenerationConfig(method="medusa", k=4, max_new_tokens=40)
    plain = decoder.generate_ids(PROMPT, GenerationConfig(method="none", max_new_tokens=40))
    alone = [(e.accepted_count, e.emitted_ids) for e in decoder.generate(PROMPT, config)]
    early_rounds = []
    from engine.methods.medusa import drafter as medusa

    original = medusa.MedusaDrafter.verified

    def counted(self, state, features):
        original(self, state, features)
        early_rounds.append(features.shape[0])

    monkeypatch.setattr(medusa.MedusaDrafter, "verified", counted)
    monkeypatch.setattr(decoder, "pipelined", True)
    early = [(e.accepted_count, e.emitted_ids) for e in decoder.generate(PROMPT, config)]
    assert early == alone and [t for _, ids in early for t in ids] == plain
    # the first round drafts too (from the prompt's features): a block of the tree's 8 nodes and its root
    assert len(early_rounds) == len(early) and set(early_rounds) == {9}


@pytest.mark.parametrize("method", TREE_METHODS)
def test_a_tree_path_in_its_first_rows_is_kept_in_place(decoder, monkeypatch, method):
    """A tree round whose accepted path is the block's first rows (nodes 0, 1, ...; nothing accepted
    included) is rolled back like a chain; the cache is compacted only for other paths. Greedy output is
    plain decoding's either way."""
    plain = decoder.generate_ids(PROMPT, GenerationConfig(method="none", max_new_tokens=40))
    compacted = []
    compact = decoder.target.compact

    def counted(start, keep):
        compacted.append(keep.tolist())
        compact(start, keep)

    monkeypatch.setattr(decoder.target, "compact", counted)
    events = list(decoder.generate(PROMPT, config_for(method, k=4, max_new_tokens=40)))
    assert [t for e in events for t in e.emitted_ids] == plain
    paths = [[i for i, t in enumerate(e.drafted) if t.accepted] for e in events]
    moved = [[0] + [i + 1 for i in p] for p in paths if p != list(range(len(p)))]
    assert compacted == moved and len(compacted) < len(events)


def test_two_block_int8_heads_draft_what_training_defines(decoder, tmp_path):
    """The drafter's heads (int8 dequantised at load, the second blocks in torch) compute the training
    module's function: lm_head(h2) with h1 = x + SiLU(W x + b), h2 = h1 + SiLU(V h1 + c), x the final-normed
    feature."""
    from engine.train import heads as train_heads

    heads = decoder.medusa_heads()
    assert heads.layers == 2 and heads.count == 4
    model_dir = Path(decoder.pair.target_name)
    module = train_heads.load_medusa(model_dir).eval()  # dequantises the same int8 file
    feature = torch.randn(64, generator=torch.Generator().manual_seed(7))  # [H], before the final norm
    runner = decoder.target
    normed = feature * torch.rsqrt(feature.pow(2).mean() + runner.spec.rms_norm_eps) * runner.norm_weight
    expected = runner.project(module(normed[None])[:, 0])  # [D, V]
    assert torch.allclose(heads.logits(runner, feature), expected, atol=1e-4)
    # a second block changes what the heads draft: without it the logits differ
    one_block = type(heads)(heads.weights, heads.biases)
    assert not torch.allclose(one_block.logits(runner, feature), expected, atol=1e-2)


@pytest.mark.parametrize("layers, int8", [(1, False), (1, True), (2, False)])
def test_every_stored_form_of_the_heads_stays_lossless(tmp_path, layers, int8):
    """One block or two, fp32 or int8 matrices: Medusa's greedy output is plain decoding's."""
    target = make_tiny_llama(tmp_path / "target", hidden=32, layers=2, seed=1)
    add_random_medusa_heads(target, 32, layers=layers, int8=int8)
    decoder = SpeculativeDecoder(load_pair(str(target), None, device="cpu", need_draft=False))
    assert decoder.medusa_heads().layers == layers
    plain = decoder.generate_ids(PROMPT, GenerationConfig(method="none", max_new_tokens=30))
    events = list(decoder.generate(PROMPT, GenerationConfig(method="medusa", k=4, max_new_tokens=30)))
    assert [t for e in events for t in e.emitted_ids] == plain


def test_bad_int8_heads_are_refused_clearly(tmp_path):
    from safetensors.torch import load_file

    from engine.errors import SpecplayError
    from engine.methods.medusa.drafter import MedusaHeads

    target = make_tiny_llama(tmp_path / "target", hidden=32, layers=2, seed=1)
    add_random_medusa_heads(target, 32)
    tensors = load_file(str(target / "medusa_heads.safetensors"))
    tensors["second.2.weight_scale"] = tensors["second.2.weight_scale"][:8].contiguous()
    save_file(tensors, str(target / "medusa_heads.safetensors"))
    with pytest.raises(SpecplayError, match=r"second.2.weight_scale has shape \[8\], expected \[32\]"):
        MedusaHeads.load(target, "cpu", torch.float32)
