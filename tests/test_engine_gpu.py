"""The engine on CUDA (kernels backend): greedy equality and chi-squared losslessness for every method."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

import test_tree_methods as heads  # noqa: E402  (random Medusa, EAGLE and EAGLE-3 heads)
from spec_fixtures import make_perturbed_copy  # noqa: E402
from tiny_models import make_tiny_llama  # noqa: E402

from engine.analysis.lossless import check_sampling  # noqa: E402
from engine.config import GenerationConfig, SamplingParams  # noqa: E402
from engine.core.decoder import SpeculativeDecoder  # noqa: E402
from engine.models.loading import load_pair  # noqa: E402

PROMPT = "the cat sat on the mat. the cat sat on the"
METHODS = [("draft", 0), ("ngram", 0), ("medusa", 0), ("medusa-fixed", 0), ("eagle", 0), ("eagle", 8),
           ("eagle3", 0), ("eagle3", 8), ("lookahead", 0)]


def build(root, vocab, hidden, layers, seed, std, dtype=torch.float32):
    target = make_tiny_llama(root / "target", vocab=vocab, hidden=hidden, layers=layers, seed=seed, std=std)
    heads.add_random_medusa_heads(target, hidden)
    heads.add_random_eagle_head(target, hidden)
    heads.add_random_eagle3_head(target, hidden, taps=tuple(range(min(2, layers))))
    add_random_ngram_table(target, vocab, seed)
    draft = make_perturbed_copy(target, root / "draft", noise=0.3, seed=2)
    return SpeculativeDecoder(load_pair(str(target), str(draft), device="cuda", dtype=dtype))


def add_random_ngram_table(target, vocab: int, seed: int) -> None:
    """A corpus table for n-gram (engine.methods.ngram.corpus_table) counted over a random token string: every
    n-gram test on the GPU drafts with its fill."""
    from engine.methods.ngram import corpus_table

    ids = torch.randint(0, vocab, (4000,), generator=torch.Generator().manual_seed(seed)).tolist()
    table = corpus_table.build([ids], vocab, pairs=64,
                               metadata={"tokenizer_sha256": corpus_table.tokenizer_sha256(target)})
    table.save(target / corpus_table.TABLE_FILE)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return build(tmp_path_factory.mktemp("gpu"), 96, 64, 2, 0, 0.15)


def test_engine_uses_the_cuda_kernels(decoder):
    pytest.importorskip("cupy")
    assert decoder.backend.name != "torch-reference"


def test_readout_buffers_are_pinned_and_taken_in_turn():
    """The readouts' host buffers (engine.core.decoder.PinnedRing): pinned, one ring per shape, each buffer
    back
    only after the ring's other buffers."""
    from engine.core.decoder import PinnedRing

    ring = PinnedRing()
    first = [ring.take((7,), torch.float32) for _ in range(PinnedRing.RING)]
    assert all(b.is_pinned() for b in first) and len({b.data_ptr() for b in first}) == PinnedRing.RING
    assert ring.take((7,), torch.float32) is first[0] and ring.take((9,), torch.float32) is not first[1]


@pytest.mark.parametrize("method,nodes", METHODS)
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_equals_plain_on_cuda(decoder, method, nodes, k):
    plain = decoder.generate_ids(PROMPT, GenerationConfig(method="none", max_new_tokens=48))
    spec = decoder.generate_ids(PROMPT, GenerationConfig(method=method, k=k, tree_nodes=nodes,
                                                         max_new_tokens=48))
    assert spec == plain


@pytest.mark.parametrize("k", [1, 4, 8])
def test_ngram_without_its_table_equals_plain_on_cuda(decoder, k):
    """Prompt lookup alone (the table off) on the GPU, as the greedy test above runs it with the table."""
    assert decoder.ngram_table() is not None
    plain = decoder.generate_ids(PROMPT, GenerationConfig(method="none", max_new_tokens=48))
    config = GenerationConfig(method="ngram", k=k, max_new_tokens=48, ngram_corpus=False)
    assert decoder.generate_ids(PROMPT, config) == plain


def test_ngram_replayed_rounds_record_the_block_they_verified(tmp_path_factory):
    """n-gram's replayed GPU round (bf16: the decode path) verifies all K slots whatever its lookup found:
    its event says K + 1, where a round launched apart (a generation's first) verified what it drafted (the
    cost model's refit bins rounds by this block)."""
    decoder = build(tmp_path_factory.mktemp("gpu_ngram_blocks"), 96, 64, 2, 0, 0.15, dtype=torch.bfloat16)
    k = 8
    config = GenerationConfig(method="ngram", k=k, max_new_tokens=48, stop_at_eos=False)
    events = list(decoder.generate(PROMPT, config))
    assert events[0].verified_tokens == len(events[0].drafted) + 1
    assert all(e.verified_tokens in (k + 1, len(e.drafted) + 1) for e in events)
    assert any(e.verified_tokens == k + 1 and len(e.drafted) < k for e in events[1:])


@pytest.mark.parametrize("method,nodes", [("draft", 0), ("eagle", 0), ("eagle", 8), ("eagle3", 0),
                                          ("medusa", 0), ("medusa-fixed", 0), ("layerskip", 0), ("suffix", 0),
                                          ("lookahead", 0)])
def test_bf16_sampling_is_lossless(tmp_path_factory, monkeypatch, method, nodes):
    """bf16 on the decode kernels, chi-squared of the first two tokens. The chains' (Medusa's) second round
    is often a replay of their round graph (engine.core.graphs), queued behind the first; suffix
    decoding's
    and lookahead's trees are verified by one upload and one replay (HostTreeRoundGraph)."""
    layers = 2 if method == "layerskip" else 1  # layer skip drafts with fewer layers than the target's
    decoder = build(tmp_path_factory.mktemp("gpu_bf16_chi"), 24, 32, layers, 11, 0.3, dtype=torch.bfloat16)
    assert decoder.pair.target.decode_kernels is not None
    replays = _count_calls(monkeypatch, "_replay_round")
    host_trees = _count_calls(monkeypatch, "_host_tree_round")  # suffix's and lookahead's: one replay each
    config = GenerationConfig(method=method, k=3, tree_nodes=nodes, sampling=SamplingParams(0.8, 0, 0.9),
                              seed=1000)
    report = check_sampling(decoder, "a tea at the tea at", config, samples=1000)
    assert report.passed, report
    drafted_on_host = method in ("suffix", "lookahead")
    assert (len(replays) > 0) == (nodes == 0 and not drafted_on_host)
    assert (len(host_trees) > 0) == drafted_on_host


@pytest.mark.parametrize("method,nodes", METHODS + [("suffix", 0), ("layerskip", 0)])
def test_bf16_greedy_equals_plain_with_every_product_on_sp_gemv(tmp_path_factory, monkeypatch, method, nodes):
    """bf16 with every product on sp_gemv, as on models with rows of GEMV_TC_K values or more (the synthetic
    1B-8B shapes; the tiny models here take sp_gemv_tc otherwise): greedy output of every method equals plain
    decoding."""
    from engine.kernels import step

    monkeypatch.setattr(step, "GEMV_TC_K", 0)
    decoder = build(tmp_path_factory.mktemp("gpu_bf16_sp_gemv"), 96, 64, 3, 0, 0.15, dtype=torch.bfloat16)
    plain = decoder.generate_ids(PROMPT, GenerationConfig(method="none", max_new_tokens=48))
    config = GenerationConfig(method=method, k=4, tree_nodes=nodes, max_new_tokens=48)
    assert decoder.generate_ids(PROMPT, config) == plain


@pytest.mark.parametrize("method", ["draft", "eagle3"])
def test_bf16_sampling_is_lossless_with_every_product_on_sp_gemv(tmp_path_factory, monkeypatch, method):
    """As test_bf16_sampling_is_lossless, with every product on sp_gemv."""
    from engine.kernels import step

    monkeypatch.setattr(step, "GEMV_TC_K", 0)
    decoder = build(tmp_path_factory.mktemp("gpu_bf16_sp_gemv_chi"), 24, 32, 1, 11, 0.3, dtype=torch.bfloat16)
    config = GenerationConfig(method=method, k=3, sampling=SamplingParams(0.8, 0, 0.9), seed=1000)
    report = check_sampling(decoder, "a tea at the tea at", config, samples=1000)
    assert report.passed, report


def _unpipelined(decoder, run):
    """run() with every round launched once the last one is read: no round replayed behind an unread one,
    no host tree verified by one upload and one replay (what the pipelined decoder must reproduce)."""
    decoder.pipelined = False
    try:
        return run()
    finally:
        decoder.pipelined = True


def _eager(decoder, run):
    """run() with CUDA graphs off: every step and chain launched op by op."""
    decoder.set_cuda_graphs(False)
    try:
        return run()
    finally:
        decoder.set_cuda_graphs(True)


def _count_calls(monkeypatch, name: str) -> list:
    """SpeculativeDecoder.<name> counted: the list grows by one per call."""
    calls = []
    original = getattr(SpeculativeDecoder, name)

    def counted(self, *args):
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(SpeculativeDecoder, name, counted)
    return calls


@pytest.fixture(scope="module")
def small_vocab_decoder(tmp_path_factory):
    return build(tmp_path_factory.mktemp("gpu_chi"), 24, 32, 1, 11, 0.3)


@pytest.mark.parametrize("method,nodes", METHODS)
@pytest.mark.parametrize("temperature", [0.8])
def test_sampling_is_lossless_on_cuda(small_vocab_decoder, method, nodes, temperature):
    config = GenerationConfig(method=method, k=3, tree_nodes=nodes,
                              sampling=SamplingParams(temperature, 0, 0.9), seed=1000)
    report = check_sampling(small_vocab_decoder, "a tea at the tea at", config, samples=1000)
    assert report.bins >= 8 and report.passed, report


@pytest.mark.parametrize("method,nodes", [("none", 0)] + METHODS)
def test_cuda_graphs_give_the_eager_tokens(decoder, method, nodes):
    """Captured graphs replay the eager step (fp32): same tokens, and they really are used."""
    config = GenerationConfig(method=method, k=4, tree_nodes=nodes, max_new_tokens=48)
    eager = _eager(decoder, lambda: decoder.generate_ids(PROMPT, config))
    graphed = decoder.generate_ids(PROMPT, config)
    assert graphed == eager
    assert decoder.target._graphs, "no CUDA graph was captured for the target"


def test_captured_outputs_survive_later_replays(decoder):
    """Callers keep a step's logits while the same graph replays for the next step."""
    target = decoder.target
    target.reset()
    with torch.inference_mode():
        target.forward(torch.arange(3, 11, device="cuda"))
        first = target.forward(torch.tensor([5], device="cuda")).logits
        kept = first.clone()
        target.forward(torch.tensor([7], device="cuda"))
    assert torch.equal(first, kept)
    assert (1, 256, ()) in target._graphs  # (n, kv width, tap layers)


@pytest.mark.parametrize("method", ["draft", "eagle"])
@pytest.mark.parametrize("k", [2, 4, 7])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_chains_replay_as_one_graph(decoder, method, k, temperature):
    """The draft model's and EAGLE's K-step chains (greedy, or sampled with the round's uniforms) are captured
    once (engine/core/graphs.py), reused by later generations, and give the eager chain's tokens."""
    from engine.core.graphs import ChainGraphs

    config = GenerationConfig(method=method, k=k, max_new_tokens=40,
                              sampling=SamplingParams(temperature, 0, 0.9), seed=7)
    eager = _eager(decoder, lambda: decoder.generate_ids(PROMPT, config))
    graphed = decoder.generate_ids(PROMPT, config)
    runner = decoder.pair.draft if method == "draft" else decoder.eagle_head().runner
    captured = len(ChainGraphs.of(runner))
    again = decoder.generate_ids(PROMPT, config)
    assert graphed == eager == again
    assert captured > 0 and len(ChainGraphs.of(runner)) == captured, "chains were not captured, or not reused"


def test_medusa_proposal_replays_as_one_graph(decoder, monkeypatch):
    """Medusa drafts from every block row behind the verification, one graph per block size (medusa_rows);
    with that off, from the accepted row (medusa). Eager or replayed, early or not: the same output."""
    from engine.core.graphs import ChainGraphs

    config = GenerationConfig(method="medusa", k=4, max_new_tokens=40)
    eager = _eager(decoder, lambda: decoder.generate_ids(PROMPT, config))
    assert decoder.generate_ids(PROMPT, config) == eager
    assert _unpipelined(decoder, lambda: decoder.generate_ids(PROMPT, config)) == eager
    kinds = {key[0] for key in ChainGraphs.of(decoder.target)._graphs}
    assert {"medusa", "medusa_rows"} <= kinds


@pytest.mark.parametrize("method", ["medusa", "medusa-fixed"])
def test_medusa_trees_equal_plain_replayed_or_eager(tmp_path_factory, monkeypatch, method):
    """Medusa's tree chosen each round (the candidates scored behind the heads' kernels, sp_tree_choose in the
    round graph) and its fixed tree (medusa-fixed): greedy output is plain decoding's, with the rounds
    replayed as graphs (counted) and with graphs off, at K = 2 and 4 and a tree of 12 nodes. bf16: the round
    graph needs the decode path, whose blocks of up to 16 rows run every product in sp_gemv, as plain
    decoding's one row does."""
    decoder = build(tmp_path_factory.mktemp("gpu_medusa_trees"), 96, 64, 2, 0, 0.15, dtype=torch.bfloat16)
    replays = _count_calls(monkeypatch, "_replay_round")
    plain = decoder.generate_ids(PROMPT, GenerationConfig(method="none", max_new_tokens=48))
    for k, nodes in ((2, 0), (4, 0), (4, 12)):
        config = GenerationConfig(method=method, k=k, tree_nodes=nodes, max_new_tokens=48)
        replayed = len(replays)
        graphed = decoder.generate_ids(PROMPT, config)
        assert len(replays) > replayed, (k, nodes)
        eager = _eager(decoder, lambda config=config: decoder.generate_ids(PROMPT, config))
        assert graphed == eager == plain, (k, nodes)


@pytest.mark.parametrize("method", ["medusa", "none"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_rounds_queued_behind_unread_ones_in_bf16(tmp_path_factory, monkeypatch, method, temperature):
    """bf16 on the decode kernels: a Medusa round (a plain step) queued before the last one is read, one
    replay of the captured round (engine.core.graphs) seeded by the first round, gives the rounds of one
    launched after the read (tokens, verdicts, uniforms); every round after the first goes that way, and the
    next generation seeds the graph again."""
    decoder = build(tmp_path_factory.mktemp("gpu_queued_after"), 96, 64, 2, 0, 0.15, dtype=torch.bfloat16)
    config = GenerationConfig(method=method, k=4, max_new_tokens=48, seed=7, stop_at_eos=False,
                              sampling=SamplingParams(temperature, 0, 0.9))

    def rounds():
        return [(e.accepted_count, e.emitted_ids, [t.u for t in e.drafted])
                for e in decoder.generate(PROMPT, config)]

    replays = _count_calls(monkeypatch, "_replay_round")
    alone = _unpipelined(decoder, rounds)
    assert not replays
    assert rounds() == alone
    assert len(replays) >= len(alone) - 2
    assert rounds() == alone


def fused_rounds_equal_eager(decoder, config) -> list:
    """The rounds (accepted count, emitted ids) launched apart (not replayed behind unread ones), with the
    drafter's round as one graph, equal those with graphs off (every step launched op by op); returns the
    fused ones."""
    def rounds():
        return [(e.accepted_count, e.emitted_ids) for e in decoder.generate(PROMPT, config)]

    eager = _unpipelined(decoder, lambda: _eager(decoder, rounds))
    fused = _unpipelined(decoder, rounds)
    assert fused == eager
    return fused


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_draft_model_round_is_one_graph_in_bf16(tmp_path_factory, monkeypatch, temperature):
    """On the decode path the draft model's forward over the committed tokens and its chain replay as one
    graph (engine.methods.draft_model.graphs.draft_model_round): the same drafts, round by round, as the
    eager steps, and greedy output equal to plain decoding."""
    from engine.core.graphs import ChainGraphs

    decoder = build(tmp_path_factory.mktemp("gpu_bf16_round"), 96, 64, 2, 0, 0.15, dtype=torch.bfloat16)
    config = GenerationConfig(method="draft", k=4, max_new_tokens=48, seed=3,
                              sampling=SamplingParams(temperature, 0, 1.0))
    fused = fused_rounds_equal_eager(decoder, config)
    # every feed length a K = 4 round can have (1..5) was captured before the first round
    lengths = {key[1] for key in ChainGraphs.of(decoder.pair.draft)._graphs if key[:1] == ("draft-round",)
               and key[2] == 4}
    assert lengths == {1, 2, 3, 4, 5}
    if temperature == 0.0:
        plain = decoder.generate_ids(PROMPT, GenerationConfig(method="none", max_new_tokens=48))
        assert [t for _, ids in fused for t in ids] == plain


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("k", [1, 4])
def test_eagle_round_is_one_graph_in_bf16(tmp_path_factory, monkeypatch, method, temperature, k):
    """On the decode path EAGLE's step over the committed positions and its chain replay as one graph
    (engine.methods.eagle.graphs.eagle_round), K = 1 included: the same rounds as the eager steps, greedy
    output equal to plain decoding, and every feed length of K (1..K+1) captured when the generation
    starts."""
    from engine.core.graphs import ChainGraphs

    decoder = build(tmp_path_factory.mktemp("gpu_bf16_eagle_round"), 96, 64, 2, 0, 0.15, dtype=torch.bfloat16)
    config = GenerationConfig(method=method, k=k, max_new_tokens=48, seed=3,
                              sampling=SamplingParams(temperature, 0, 1.0))
    fused = fused_rounds_equal_eager(decoder, config)
    head = decoder.eagle_head() if method == "eagle" else decoder.eagle3_head()
    lengths = {key[1] for key in ChainGraphs.of(head.runner)._graphs if key[:1] == ("eagle-round",)
               and key[2] == k}
    assert lengths == set(range(1, k + 2))
    if temperature == 0.0:
        plain = decoder.generate_ids(PROMPT, GenerationConfig(method="none", max_new_tokens=48))
        assert [t for _, ids in fused for t in ids] == plain


@pytest.mark.parametrize("method,nodes", [("eagle", 0), ("eagle3", 0), ("draft", 0), ("ngram", 0),
                                          ("layerskip", 0), ("eagle", 8), ("eagle3", 8)])
@pytest.mark.parametrize("k", [1, 4])
def test_chain_rounds_queued_as_replays_in_bf16(tmp_path_factory, monkeypatch, method, nodes, k):
    """bf16 on the decode kernels: EAGLE's (EAGLE-3's, the draft model's, n-gram's, layer skip's) chain
    round, or EAGLE's tree of 8, queued behind an unread one is a replay of its round graph
    (engine.core.graphs): the drafter reads the last block's rows (n-gram: the committed tokens) on the
    device, the chain or tree and the target's block follow the accepted path. Greedy output equals plain
    decoding with the replays and without them, every round after the first two is a replay, and the next
    generation reseeds the graph."""
    decoder = build(tmp_path_factory.mktemp("gpu_bf16_replay"), 96, 64, 2, 0, 0.15, dtype=torch.bfloat16)
    config = GenerationConfig(method=method, k=k, tree_nodes=nodes, max_new_tokens=48)
    plain = decoder.generate_ids(PROMPT, GenerationConfig(method="none", max_new_tokens=48))
    replays = _count_calls(monkeypatch, "_replay_round")
    launched = _unpipelined(decoder, lambda: decoder.generate_ids(PROMPT, config))
    assert not replays
    events = list(decoder.generate(PROMPT, config))
    assert [t for e in events for t in e.emitted_ids] == launched == plain
    assert len(replays) >= len(events) - 2
    if method == "draft":  # the random EAGLE heads here seldom hit (tests/test_round_graph.py: shipped ones)
        assert sum(e.accepted_count for e in events) > 0
    assert decoder.generate_ids(PROMPT, config) == plain


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_trees_are_drafted_on_the_device(decoder, monkeypatch, method):
    """An EAGLE tree reaches the verification with its parents and block on the device (no mid-round copy),
    and its rounds are the rounds of the tree copied to the host (a target without device trees)."""
    from engine.models.llama import LlamaRunner

    config = GenerationConfig(method=method, k=4, tree_nodes=8, max_new_tokens=48)
    seen = []
    verify = SpeculativeDecoder._verify

    def recording(self, state, draft, *args, **kw):
        if draft.is_tree:
            seen.append((draft.parents.device.type, draft.tree_block is not None))
        return verify(self, state, draft, *args, **kw)

    monkeypatch.setattr(SpeculativeDecoder, "_verify", recording)
    on_device = list(decoder.generate(PROMPT, config))
    assert seen and set(seen) == {("cuda", True)}
    seen.clear()
    monkeypatch.setattr(LlamaRunner, "takes_device_trees", False)
    on_host = list(decoder.generate(PROMPT, config))
    assert seen and set(seen) == {("cpu", False)}

    def rounds(events):
        return [[(t.token_id, t.parent, t.accepted) for t in e.drafted] + [e.next_token_id] for e in events]

    assert rounds(on_device) == rounds(on_host)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_eagle_tree_round_is_one_graph_in_bf16(tmp_path_factory, monkeypatch, method, temperature):
    """On the decode path the head's step over the committed positions and the tree's growth replay as one
    graph (engine.methods.eagle.drafter.tree_round): the same rounds as the eager steps, every feed length
    1..K+1 captured when the generation starts, and greedy output equal to plain decoding."""
    from engine.core.graphs import ChainGraphs

    decoder = build(tmp_path_factory.mktemp("gpu_bf16_tree_round"), 96, 64, 2, 0, 0.15, dtype=torch.bfloat16)
    config = GenerationConfig(method=method, k=4, tree_nodes=8, max_new_tokens=48, seed=3,
                              sampling=SamplingParams(temperature, 0, 1.0))
    fused = fused_rounds_equal_eager(decoder, config)
    head = decoder.eagle_head() if method == "eagle" else decoder.eagle3_head()
    lengths = {key[1] for key in ChainGraphs.of(head.runner)._graphs if key[0] == "eagle-tree-round"}
    assert lengths == set(range(1, 6))
    if temperature == 0.0:
        plain = decoder.generate_ids(PROMPT, GenerationConfig(method="none", max_new_tokens=48))
        assert [t for _, ids in fused for t in ids] == plain


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_kernel_workspaces_are_made_outside_captures(tmp_path_factory, monkeypatch, temperature):
    """Every verification and sp_wide workspace is made by a warm-up, on the stream the capture then uses
    (engine.models.runner.capture_stream), never inside a capture: made there, its zeroing would be a node of
    one
    graph and its memory that graph's pool's (an illegal address in a sampled K sweep on an H200). A large
    vocabulary takes sp_wide for chains; the sampled rounds are replayed for the check."""
    from engine.kernels import cuda as kernels_cuda
    from engine.kernels.workspaces import Workspaces

    made_while_capturing = []
    for name in ("verify", "wide"):
        original = getattr(Workspaces, name)

        def recorded(self, stream_ptr, *args, _original=original):
            before = set(map(id, self.outgrown)) | {id(w) for w in self.current_verify.values()} \
                | {id(w) for w in self.current_wide.values()}
            ws = _original(self, stream_ptr, *args)
            if id(ws) not in before:
                made_while_capturing.append(torch.cuda.is_current_stream_capturing())
            return ws

        monkeypatch.setattr(Workspaces, name, recorded)
    decoder = build(tmp_path_factory.mktemp("gpu_workspaces"), 4096, 64, 2, 0, 0.15, dtype=torch.bfloat16)
    state = kernels_cuda._device(torch.cuda.current_device())
    monkeypatch.setattr(state, "workspaces", Workspaces(state.device))  # made anew here, not by earlier tests
    for method, k in (("none", 0), ("draft", 1), ("draft", 4), ("eagle", 6), ("medusa", 4)):
        config = GenerationConfig(method=method, k=max(k, 1), max_new_tokens=40, stop_at_eos=False, seed=3,
                                  sampling=SamplingParams(temperature, 0, 1.0))
        decoder.generate_ids(PROMPT, config)
    assert made_while_capturing and not any(made_while_capturing)


def test_warm_up_captures_every_round_block_size(tmp_path):
    """The target's decode steps of 1..17 rows are captured at warm-up, so that no round of n-gram (a draft
    of any length up to K) captures one inside a generation."""
    target = make_tiny_llama(tmp_path / "target", vocab=96, hidden=64, layers=2, seed=0, std=0.15)
    decoder = SpeculativeDecoder(load_pair(str(target), None, device="cuda", need_draft=False,
                                           dtype=torch.bfloat16))
    decoder.warm_up()
    steps = decoder.target._graphs
    assert set(range(1, 18)) <= {key[0] for key in steps if key[1] == 0}
    captured = len(steps)
    for _ in decoder.generate(PROMPT, GenerationConfig(method="ngram", k=8, max_new_tokens=40)):
        pass
    assert len(steps) == captured


@pytest.mark.parametrize("method", ["suffix", "lookahead"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_host_trees_are_one_upload_and_one_replay_in_bf16(tmp_path_factory, monkeypatch, method, temperature):
    """bf16 on the decode kernels: a tree drafted on the host (engine.core.graphs.HostTreeRoundGraph),
    one
    upload and one replay that also keeps the accepted path in the cache, gives the rounds queued op by op
    (tokens, verdicts, uniforms); every round goes that way (an empty draft's too), and greedy output is
    plain decoding's."""
    from engine.core.graphs import HostTreeRoundGraph

    decoder = build(tmp_path_factory.mktemp(f"gpu_host_tree_{method}"), 96, 64, 2, 0, 0.15,
                    dtype=torch.bfloat16)
    config = GenerationConfig(method=method, k=4, max_new_tokens=48, seed=7, stop_at_eos=False,
                              sampling=SamplingParams(temperature, 0, 0.9))

    def rounds():
        decoder.suffix_memory().clear()  # each run drafts from its own tokens alone
        return [(e.accepted_count, e.emitted_ids, [t.u for t in e.drafted])
                for e in decoder.generate(PROMPT, config)]

    uploads = []
    original = HostTreeRoundGraph.upload

    def counted(self, *args):
        uploads.append(self.nodes)
        return original(self, *args)

    monkeypatch.setattr(HostTreeRoundGraph, "upload", counted)
    apart = _unpipelined(decoder, rounds)
    assert not uploads
    assert rounds() == apart
    drafted = sum(1 for _, _, us in apart if us)
    assert drafted >= 3 and len(uploads) == len(apart)  # an empty draft's round too
    if temperature == 0.0:
        plain = decoder.generate_ids(PROMPT, GenerationConfig(method="none", max_new_tokens=48,
                                                              stop_at_eos=False))
        assert [t for _, ids, _ in apart for t in ids] == plain
