"""Round graphs (engine/core/graphs.py) on the CPU: there replay() runs the round eagerly, so the
decoder's
rounds queued behind unread ones (the seeding, the self-fed buffers, the cache's bookkeeping, the drafters'
host views, the fall back to rounds launched apart) run here as they do on the GPU, against the synchronous
loop and plain decoding."""
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from spec_fixtures import make_perturbed_copy
from test_tree_methods import PROMPT, add_random_eagle3_head, add_random_eagle_head, add_random_medusa_heads
from tiny_models import make_tiny_llama

import engine.core.decoder
import engine.core.graphs
import engine.methods.draft_model.drafter as draft_model
import engine.methods.eagle.drafter as eagle
import engine.methods.layerskip.drafter as layerskip
import engine.methods.ngram.drafter as ngram
from engine.analysis.lossless import check_sampling
from engine.config import GenerationConfig, SamplingParams
from engine.core.decoder import SpeculativeDecoder
from engine.core.graphs import HostTreeRoundGraph, PlainRoundGraph, chain_sampling, tree_shape
from engine.methods.draft_model.graphs import DraftModelRoundGraph
from engine.methods.eagle.graphs import EagleRoundGraph, EagleTreeRoundGraph
from engine.methods.layerskip.graphs import LayerSkipRoundGraph
from engine.methods.medusa.drafter import MedusaDrafter
from engine.methods.medusa.graphs import MedusaRoundGraph
from engine.methods.ngram.graphs import NgramRoundGraph, ngram_lookup
from engine.models.loading import load_pair
from engine.models.runner import tree_ancestor_mask, tree_depths


def _decoder(root, vocab=96, hidden=64, layers=2, seed=0, std=0.02):
    target = make_tiny_llama(root / "target", vocab=vocab, hidden=hidden, layers=layers, seed=seed, std=std)
    add_random_medusa_heads(target, hidden)
    add_random_eagle_head(target, hidden)
    add_random_eagle3_head(target, hidden, taps=tuple(range(min(2, layers))))
    draft = make_perturbed_copy(target, root / "draft", noise=0.3, seed=2)
    return SpeculativeDecoder(load_pair(str(target), str(draft), device="cpu"))


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return _decoder(tmp_path_factory.mktemp("round_graph"))


SHIPPED = Path(__file__).resolve().parents[1] / "assets" / "models"


@pytest.fixture(scope="module")
def shipped():
    """The shipped pair (its EAGLE heads accept paths, which random heads seldom do) and a held-out prompt."""
    if not (SHIPPED / "target").exists():
        pytest.skip("assets/models/target not present")
    prompt = json.loads((SHIPPED / "heldout_prompts.json").read_text())["prompts"][0]["text"]
    pair = load_pair(str(SHIPPED / "target"), str(SHIPPED / "draft"), device="cpu")
    return SpeculativeDecoder(pair), prompt


@pytest.fixture
def queued(monkeypatch):
    """Rounds pipelined (as on the GPU) and the drafters' round graphs built here, one per shape; returns the
    list that counts the replays."""
    graphs, replays = {}, []

    def medusa_graph(self, state, config, width):
        if self.early is None:
            return None
        tree, _ = self._tree(*self._shape(config.k))
        s = config.sampling
        warp = None if s.greedy else (s.temperature, s.top_k, s.top_p)
        key = ("medusa", id(self.heads), tree, warp)
        if key not in graphs:
            graphs[key] = MedusaRoundGraph(self.target, self.heads, tree, state.backend, state.vocab_size,
                                           width, warp)
        return graphs[key]

    def eagle_graph(self, state, config, width):
        if self.true_length == 0:
            return None
        if self.tree_nodes:
            if not state.config.sampling.greedy:
                return None
            key = ("eagle-tree", id(self.head), config.k, self.tree_nodes)
            if key not in graphs:
                graphs[key] = EagleTreeRoundGraph(self.target, self.head, config.k, self.tree_nodes,
                                                  state.backend, state.vocab_size, width, eagle._grow_tree,
                                                  eagle._tree_size(config.k))
            return graphs[key]
        sampling = chain_sampling(state)
        key = ("eagle", id(self.head), config.k, None if sampling is None else sampling.key)
        if key not in graphs:
            graphs[key] = EagleRoundGraph(self.target, self.head, config.k, state.backend, state.vocab_size,
                                          width, sampling)
        return graphs[key]

    def runner_chain_graph(name, graph_class, runner, target, state, k, width):
        """A drafter whose draft runner feeds the target in a chain (draft model, layer skip)."""
        sampling = chain_sampling(state)
        key = (name, id(runner), k, None if sampling is None else sampling.key)
        if key not in graphs:
            graphs[key] = graph_class(runner, target, k, state.backend, state.vocab_size, width, sampling)
        return graphs[key]

    def draft_graph(self, state, config, width):
        return runner_chain_graph("draft", DraftModelRoundGraph, self.runner, self.round_target, state,
                                  config.k, width)

    def layerskip_graph(self, state, config, width):
        return runner_chain_graph("layerskip", LayerSkipRoundGraph, self.runner, self.target, state,
                                  config.k, width)

    def ngram_graph(self, state, config, width):
        if not state.config.sampling.greedy:
            return None
        key = ("ngram", id(self.target), config.k, state.config.ngram_n, id(self.table))
        if key not in graphs:
            graphs[key] = NgramRoundGraph(self.target, config.k, state.config.ngram_n, state.backend, width,
                                          self.table)
        return graphs[key]

    def plain_graph(target, backend, width, sampling=None):
        key = ("plain", id(target), width, None if sampling is None else sampling.key)
        if key not in graphs:
            graphs[key] = PlainRoundGraph(target, backend, width, sampling)
        return graphs[key]

    original = SpeculativeDecoder._replay_round

    def counted(self, *args):
        launched = original(self, *args)
        replays.append(launched is not None)
        return launched

    monkeypatch.setattr(MedusaDrafter, "round_graph", medusa_graph)
    monkeypatch.setattr(eagle.EagleDrafter, "round_graph", eagle_graph)
    monkeypatch.setattr(draft_model.DraftModelDrafter, "round_graph", draft_graph)
    monkeypatch.setattr(engine.core.decoder, "plain_round_graph", plain_graph)
    monkeypatch.setattr(layerskip.LayerSkipDrafter, "round_graph", layerskip_graph)
    monkeypatch.setattr(ngram.NgramDrafter, "round_graph", ngram_graph)
    monkeypatch.setattr(SpeculativeDecoder, "_replay_round", counted)
    return replays


def _rounds(decoder, config, pipelined: bool, prompt: str = PROMPT) -> list:
    decoder.pipelined = pipelined
    try:
        return [(e.emitted_ids, e.accepted_count, [(t.token_id, t.u, t.accepted) for t in e.drafted],
                 e.finish_reason) for e in decoder.generate(prompt, config)]
    finally:
        decoder.pipelined = False


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_medusa_replays_give_the_synchronous_rounds(decoder, queued, temperature, k):
    """Medusa's replayed rounds are the rounds launched once the last is read: tokens, verdicts, uniforms."""
    config = GenerationConfig(method="medusa", k=k, sampling=SamplingParams(temperature, 0, 0.9),
                              max_new_tokens=60, seed=3)
    alone = _rounds(decoder, config, pipelined=False)
    assert not queued
    assert _rounds(decoder, config, pipelined=True) == alone
    assert sum(queued) >= len(alone) - 2
    assert _rounds(decoder, config, pipelined=True) == alone  # the next generation seeds the graph again


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("k", [1, 4])
def test_layerskip_replays_give_the_synchronous_rounds(decoder, queued, temperature, k):
    """Layer skip's replayed rounds (its draft layers feeding the next token into the target's own cache on
    the device) are the rounds launched apart: tokens, verdicts, uniforms; the next generation too."""
    config = GenerationConfig(method="layerskip", k=k, sampling=SamplingParams(temperature, 0, 0.9),
                              max_new_tokens=48, seed=3)
    alone = _rounds(decoder, config, pipelined=False)
    assert not queued and sum(accepted for _, accepted, _, _ in alone) > 0
    assert _rounds(decoder, config, pipelined=True) == alone
    assert sum(queued) >= len(alone) - 2
    assert _rounds(decoder, config, pipelined=True) == alone


def test_layerskip_rounds_launched_apart_between_replays(decoder, queued, monkeypatch):
    config = GenerationConfig(method="layerskip", k=4, max_new_tokens=48)
    alone = _rounds(decoder, config, pipelined=False)
    calls = _refuse_every_third(monkeypatch)
    assert _rounds(decoder, config, pipelined=True) == alone
    assert sum(queued) >= len(alone) // 2 and len(calls) > sum(queued)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_plain_replays_give_the_synchronous_rounds(decoder, queued, temperature):
    """Plain decoding's steps replayed behind unread ones are the rounds launched apart: tokens and
    uniforms."""
    config = GenerationConfig(method="none", sampling=SamplingParams(temperature, 0, 0.9), max_new_tokens=40,
                              seed=5, stop_at_eos=False)
    alone = _rounds(decoder, config, pipelined=False)
    assert len(alone) == 40 and not queued
    assert _rounds(decoder, config, pipelined=True) == alone
    assert sum(queued) == len(alone) - 1
    assert _rounds(decoder, config, pipelined=True) == alone  # the next generation seeds the graph again


def test_the_device_lookup_is_the_host_lookup():
    """ngram_lookup (fixed shapes, on the device in a round graph) proposes what lookup_continuation does, on
    random token strings over a few symbols (many matches, of every length), stray tokens past them."""
    generator = torch.Generator().manual_seed(0)
    for case in range(600):
        length = 1 + case % 40
        max_n, k = 1 + case % 4, 1 + case % 8
        tokens = torch.randint(0, 2 + case % 4, (length,), generator=generator).tolist()
        history = torch.randint(0, 9, (length + 16,), generator=generator)  # stray ids past the tokens
        history[:length] = torch.tensor(tokens)
        proposal, count = ngram_lookup(history, torch.tensor([length]), max_n, k)
        expected = ngram.lookup_continuation(tokens, max_n, k)
        found = proposal[:len(expected)].tolist()
        assert int(count) == len(expected) and found == expected, (tokens, max_n, k)


def random_table(vocab: int, width: int, pairs: int, generator):
    """A CorpusTable over `vocab` ids with rows cut short at random (-1 past a row's end)."""
    from engine.methods.ngram.corpus_table import CorpusTable

    def rows(n: int) -> torch.Tensor:
        out = torch.randint(0, vocab, (n, width), generator=generator)
        ends = torch.randint(0, width + 1, (n, 1), generator=generator)
        return torch.where(torch.arange(width) < ends, out, -1)

    keys = torch.randperm(vocab * vocab, generator=generator)[:pairs].sort().values
    return CorpusTable(rows(vocab), keys, rows(keys.numel()), {})


def test_the_device_lookup_with_a_corpus_table_is_the_host_lookup():
    """With a corpus table, ngram_lookup (corpus_fill after the lookup) proposes what lookup_continuation
    does: misses, short matches at the context's end and full ones, pairs found and not, rows cut short."""
    generator = torch.Generator().manual_seed(1)
    for case in range(600):
        length = 1 + case % 30
        max_n, k, vocab = 1 + case % 4, 1 + case % 8, 3 + case % 5
        table = random_table(vocab, 1 + case % 5, case % 7 * 2, generator)
        tokens = torch.randint(0, vocab, (length,), generator=generator).tolist()
        history = torch.randint(0, vocab, (length + 16,), generator=generator)
        history[:length] = torch.tensor(tokens)
        proposal, count = ngram_lookup(history, torch.tensor([length]), max_n, k, table)
        expected = ngram.lookup_continuation(tokens, max_n, k, table)
        assert int(count) == len(expected) and proposal[:len(expected)].tolist() == expected, (case, tokens)


def test_lookup_continuation_fills_from_the_table():
    from engine.methods.ngram.corpus_table import CorpusTable

    chain = torch.tensor([[1, 2], [2, -1], [0, 0]])  # after 0: 1 2; after 1: 2; after 2: 0 0
    table = CorpusTable(chain, torch.tensor([1 * 3 + 2]), torch.tensor([[1, 1]]), {})  # after (1, 2): 1 1
    assert ngram.lookup_continuation([2], 3, 4, table) == [0, 0]  # a miss: the last token's row
    assert ngram.lookup_continuation([1, 2], 3, 4, table) == [1, 1]  # the pair's row
    assert ngram.lookup_continuation([0, 1, 0], 3, 3, table) == [1, 0, 1]  # the match ends at the end: filled
    assert ngram.lookup_continuation([0, 1, 0], 3, 3) == [1, 0]
    assert ngram.lookup_continuation([1], 3, 4, table) == [2]  # the row ends


def test_the_device_lookup_reads_nothing_on_the_host():
    """A CUDA graph's capture fails at the first read of a device value on the host (indexing by a 0-d
    tensor is one). Meta tensors hold no values, so such a read raises here as well."""
    history = torch.zeros(64, dtype=torch.long, device="meta")
    proposal, count = ngram_lookup(history, torch.zeros(1, dtype=torch.long, device="meta"), 3, 4)
    assert proposal.shape == (4,) and count.shape == (1,)
    table = random_table(8, 4, 6, torch.Generator().manual_seed(0)).to("meta")
    proposal, count = ngram_lookup(history, torch.zeros(1, dtype=torch.long, device="meta"), 3, 4, table)
    assert proposal.shape == (4,) and count.shape == (1,)


def test_a_capture_that_failed_is_not_tried_again(monkeypatch):
    """A round whose graph cannot be captured runs without one, and later rounds do not capture again (each
    try costs a warm-up and a capture: n-gram's rounds ran at 230 tokens/s so)."""
    from types import SimpleNamespace

    from engine.core.graphs import ChainGraphs

    tries = []

    def failing():
        tries.append(1)
        raise RuntimeError("operation failed due to a previous error during capture")

    graphs = ChainGraphs(SimpleNamespace(pool_handle=None))
    assert graphs.get(("ngram_round", 4), failing) is None
    attempts = len(tries)
    assert attempts >= 1 and graphs.get(("ngram_round", 4), failing) is None and len(tries) == attempts
    assert graphs.get(("other", 4), lambda: "graph") == "graph"


def test_a_chain_past_the_lookup_count_is_cut_there():
    """Accepted past the lookup's count (the chain's stray tail matched the target), the round stops at the
    count: the next token is the target's argmax there, which the chain's token at that row matched. Within
    the count, and for the NaN flag, the verification's result is kept."""
    from engine.kernels.reference import VerifyResult, chain_limit_reference

    def result(accepted, next_token):
        path = [i if i < accepted else -1 for i in range(4)]
        return VerifyResult(torch.tensor([accepted]), torch.tensor([next_token]), torch.tensor([path]),
                            torch.zeros(1, 4), torch.ones(1, 4), torch.zeros(1, 4),
                            torch.tensor([[i <= accepted for i in range(4)]]))

    chain, count = torch.tensor([5, 6, 7, 8]), torch.tensor([2])
    cut = chain_limit_reference(result(4, 9), chain, count)
    assert cut.accepted.tolist() == [2] and cut.next_token.tolist() == [7]
    assert cut.path.tolist() == [[0, 1, -1, -1]] and cut.tested.tolist() == [[True, True, False, False]]
    kept = chain_limit_reference(result(1, 3), chain, count)
    assert kept.accepted.tolist() == [1] and kept.next_token.tolist() == [3]
    assert kept.path.tolist()[0][:2] == [0, -1]
    assert chain_limit_reference(result(3, -1), chain, count).next_token.tolist() == [-1]


@pytest.mark.parametrize("corpus", [False, True])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_ngram_replays_give_the_synchronous_rounds(shipped, queued, k, corpus):
    """n-gram rounds replayed behind unread ones (the lookup on the device, the chain cut to its count, with
    the shipped corpus table's fill or without) are the rounds launched apart: drafted tokens, verdicts,
    misses included; greedy output is plain decoding's."""
    decoder, prompt = shipped
    assert decoder.ngram_table() is not None  # the shipped target ships one
    config = GenerationConfig(method="ngram", k=k, max_new_tokens=64, ngram_corpus=corpus)
    alone = _rounds(decoder, config, False, prompt)
    misses = sum(not drafted for _, _, drafted, _ in alone)
    assert not queued and (misses < len(alone) // 4 if corpus else misses > 0)  # the table fills the misses
    assert _rounds(decoder, config, True, prompt) == alone
    assert sum(queued) >= len(alone) - 2 and sum(accepted for _, accepted, _, _ in alone) > len(alone) // 2
    plain = decoder.generate_ids(prompt, GenerationConfig(method="none", max_new_tokens=64))
    assert [t for ids, *_ in alone for t in ids] == plain


def test_ngram_rounds_launched_apart_between_replays(shipped, queued, monkeypatch):
    decoder, prompt = shipped
    config = GenerationConfig(method="ngram", k=4, max_new_tokens=64)
    alone = _rounds(decoder, config, False, prompt)
    calls = _refuse_every_third(monkeypatch)
    assert _rounds(decoder, config, True, prompt) == alone
    assert sum(queued) >= len(alone) // 2 and len(calls) > sum(queued)


def test_medusa_replays_on_the_shipped_pair(shipped, queued):
    """With the shipped heads, whose paths are accepted: the replayed rounds are the synchronous ones."""
    decoder, prompt = shipped
    config = GenerationConfig(method="medusa", k=4, max_new_tokens=48)
    alone = _rounds(decoder, config, False, prompt)
    assert _rounds(decoder, config, True, prompt) == alone
    assert sum(queued) >= len(alone) - 2 and sum(accepted for _, accepted, _, _ in alone) > len(alone) // 3


@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft"])
@pytest.mark.parametrize("k", [1, 4])
def test_chain_replays_are_lossless(shipped, queued, method, k):
    """EAGLE's and the draft model's chain rounds replayed behind unread ones (their drafter reading a fixed
    number of rows, the stray ones written over by the chain) give plain decoding's greedy output on the
    shipped pair, with paths accepted and every round after the first two a replay; so does the next
    generation."""
    decoder, prompt = shipped
    plain = decoder.generate_ids(prompt, GenerationConfig(method="none", max_new_tokens=48))
    config = GenerationConfig(method=method, k=k, max_new_tokens=48)
    rounds = _rounds(decoder, config, True, prompt)
    assert [t for ids, *_ in rounds for t in ids] == plain
    assert sum(queued) >= len(rounds) - 2 and sum(accepted for _, accepted, _, _ in rounds) > len(rounds) // 2
    assert [t for ids, *_ in _rounds(decoder, config, True, prompt) for t in ids] == plain


def _refuse_every_third(monkeypatch) -> list:
    """Every third queued round refused (as when the cache might not hold it): the list counts the tries."""
    replay = SpeculativeDecoder._replay_round  # the counted one
    calls = []

    def every_third_refused(self, *args):
        calls.append(1)
        return None if len(calls) % 3 == 0 else replay(self, *args)

    monkeypatch.setattr(SpeculativeDecoder, "_replay_round", every_third_refused)
    return calls


def test_medusa_rounds_launched_apart_between_replays(decoder, queued, monkeypatch):
    """Every third queued round refused: the round after it is launched once the last is read, and the
    replay after that seeds the graph from it. The rounds are the synchronous loop's."""
    config = GenerationConfig(method="medusa", k=4, max_new_tokens=60)
    alone = _rounds(decoder, config, pipelined=False)
    calls = _refuse_every_third(monkeypatch)
    assert _rounds(decoder, config, pipelined=True) == alone
    assert sum(queued) >= len(alone) // 2 and len(calls) > sum(queued)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("k", [2, 4])
def test_eagle_tree_replays_give_the_synchronous_rounds(shipped, queued, method, k):
    """EAGLE's trees replayed behind unread ones (the head reading the last block's root and path rows, the
    tree grown at a true length known on the device, the last path kept in the cache there) are the rounds
    launched apart: the tree, the verdicts, the output; the next generation seeds the graph again."""
    decoder, prompt = shipped
    config = GenerationConfig(method=method, k=k, tree_nodes=8, max_new_tokens=48)
    alone = _rounds(decoder, config, False, prompt)
    assert not queued
    assert _rounds(decoder, config, True, prompt) == alone
    assert sum(queued) >= len(alone) - 2 and sum(accepted for _, accepted, _, _ in alone) > len(alone)
    plain = decoder.generate_ids(prompt, GenerationConfig(method="none", max_new_tokens=48))
    assert [t for ids, *_ in alone for t in ids] == plain
    assert _rounds(decoder, config, True, prompt) == alone


def test_eagle_tree_rounds_launched_apart_between_replays(shipped, queued, monkeypatch):
    decoder, prompt = shipped
    config = GenerationConfig(method="eagle3", k=4, tree_nodes=8, max_new_tokens=48)
    alone = _rounds(decoder, config, False, prompt)
    calls = _refuse_every_third(monkeypatch)
    assert _rounds(decoder, config, True, prompt) == alone
    assert sum(queued) >= len(alone) // 2 and len(calls) > sum(queued)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft"])
def test_chain_rounds_launched_apart_between_replays(shipped, queued, monkeypatch, method):
    """As for Medusa, on the shipped pair: the rounds launched apart read the drafter's host view of the
    replays (RoundCommit.fed_ahead: EAGLE's head's true length and pending rows, the draft model's
    committed count and cache length). Greedy output is plain decoding's."""
    decoder, prompt = shipped
    plain = decoder.generate_ids(prompt, GenerationConfig(method="none", max_new_tokens=48))
    calls = _refuse_every_third(monkeypatch)
    rounds = _rounds(decoder, GenerationConfig(method=method, k=4, max_new_tokens=48), True, prompt)
    assert [t for ids, *_ in rounds for t in ids] == plain
    assert sum(queued) >= len(rounds) // 2 and len(calls) > sum(queued)


@pytest.mark.slow  # a statistical check: `make test-fast` skips it
@pytest.mark.parametrize("method", ["none", "medusa", "eagle", "eagle3", "draft"])
def test_replayed_sampling_is_lossless(tmp_path_factory, queued, method):
    """Chi-squared of the first two tokens with the second round replayed when the first is not enough."""
    decoder = _decoder(tmp_path_factory.mktemp(f"chi_replay_{method}"), vocab=24, hidden=32, layers=1,
                       seed=11, std=0.3)
    decoder.pipelined = True
    try:
        config = GenerationConfig(method=method, k=3, sampling=SamplingParams(0.8, 0, 0.9), seed=500)
        report = check_sampling(decoder, "a tea at the tea at", config, samples=800)
    finally:
        decoder.pipelined = False
    assert report.bins >= 8 and report.passed, report
    assert sum(queued) > 100



@pytest.fixture
def host_trees(monkeypatch):
    """Host-drafted trees verified by HostTreeRoundGraph here (its replay runs eagerly on the CPU), one graph
    per shape; returns the list that counts the uploads."""
    graphs, uploads = {}, []

    def graph(target, nodes, backend, width, warp=None):
        key = (id(target), nodes, width, warp)
        if key not in graphs:
            graphs[key] = HostTreeRoundGraph(target, nodes, backend, width, warp)
        return graphs[key]

    original = HostTreeRoundGraph.upload

    def counted(self, *args):
        uploads.append(self.nodes)
        return original(self, *args)

    monkeypatch.setattr(engine.core.decoder, "host_tree_round_graph", graph)
    monkeypatch.setattr(HostTreeRoundGraph, "upload", counted)
    return uploads


@pytest.mark.parametrize("method", ["suffix", "lookahead"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("k", [1, 4])
def test_host_tree_replays_give_the_rounds_launched_op_by_op(decoder, host_trees, method, temperature, k):
    """A host tree verified by one upload and one replay gives the rounds queued op by op: tokens, verdicts,
    uniforms; and the graph path was the one taken."""
    sampling = SamplingParams(temperature, 0, 0.9)
    config = GenerationConfig(method=method, k=k, max_new_tokens=40, sampling=sampling, seed=7)
    decoder.suffix_memory().clear()  # each run drafts from its own tokens alone
    launched_apart = _rounds(decoder, config, pipelined=False)
    decoder.suffix_memory().clear()
    replayed = _rounds(decoder, config, pipelined=True)
    assert replayed == launched_apart
    assert len(host_trees) >= 3 and max(host_trees) > 1
    if temperature == 0:
        plain = decoder.generate_ids(PROMPT, replace(config, method="none"))
        assert [t for e in replayed for t in e[0]] == plain


def test_host_tree_shape_is_the_runner_tree_block():
    """tree_shape's depths and mask are the runner's tree block (tree_depths, tree_ancestor_mask) of the
    block [last committed token] + tree, for random trees; bad parents are refused."""
    generator = torch.Generator().manual_seed(3)
    for n in range(1, 17):
        parents = [int(torch.randint(-1, i, (1,), generator=generator)) for i in range(n)]
        block = torch.tensor([-1] + [p + 1 for p in parents])
        depths, mask = tree_shape(tuple(parents))
        assert depths.tolist() == tree_depths(block).tolist()
        assert mask.reshape(n + 1, n + 1).astype(bool).tolist() == tree_ancestor_mask(block).tolist()
    with pytest.raises(ValueError, match="topologically"):
        tree_shape((-1, 1))
