"""The published EAGLE-1 and EAGLE-3 heads on CUDA (fp32 and bf16): their rounds are captured as the
project's own heads' are (the head's step and chain as one graph, eagle_round / eagle_chain over
HeadLayer.block_step; the whole round with the target's verification, EagleRoundGraph), greedy output equals
plain decoding with graphs on and off, and their trees (grown through the graph path) stay lossless too."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from test_public_heads import (  # noqa: E402
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    PROMPT,
    VOCAB,
    make_eagle1,
    make_eagle3,
)
from tiny_models import make_tiny_llama  # noqa: E402

from engine.config import GenerationConfig  # noqa: E402
from engine.core.decoder import SpeculativeDecoder  # noqa: E402
from engine.core.graphs import ChainGraphs  # noqa: E402
from engine.models.loading import load_pair  # noqa: E402

LAYOUTS = {"eagle1": ("eagle", make_eagle1), "eagle3": ("eagle3", make_eagle3)}
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("public_gpu")
    return make_tiny_llama(root / "target", vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, heads=HEADS,
                           kv_heads=KV_HEADS, seed=5, std=0.3)


def decoder_on_cuda(target_dir, folder, layout, dtype):
    method, make = LAYOUTS[layout]
    pair = load_pair(str(target_dir), None, device="cuda", need_draft=False, dtype=dtype)
    decoder = SpeculativeDecoder(pair)
    decoder.use_heads(str(make(folder / layout)))
    head = decoder.eagle_head() if method == "eagle" else decoder.eagle3_head()
    return decoder, method, head


def generate(decoder, method, k, nodes=0):
    config = GenerationConfig(method=method, k=k, tree_nodes=nodes, max_new_tokens=NEW_TOKENS,
                              stop_at_eos=False)
    return decoder.generate_ids(PROMPT, config)


def captured_chains(head, k):
    """The head's captured chains at K: alone (eagle, K, kv, ..) or with its step (eagle-round, n, K, ..)."""
    keys = ChainGraphs.of(head.runner)._graphs
    return [key for key in keys if (key[0] == "eagle" and key[1] == k) or (key[0] == "eagle-round"
                                                                            and key[2] == k)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [2, 5])
def test_chain_is_captured_and_greedy_equals_plain(target_dir, tmp_path, layout, dtype, k):
    decoder, method, head = decoder_on_cuda(target_dir, tmp_path, layout, dtype)
    assert head.runner.use_graphs and ChainGraphs.available(head.runner, k)
    plain = generate(decoder, "none", 1)
    assert generate(decoder, method, k) == plain
    chains = captured_chains(head, k)
    assert chains, "the head's chain was not captured"
    rounds = [key for key in ChainGraphs.of(decoder.target)._graphs if key[0] == "eagle_round"]
    if decoder.target.decode_path(k + 1):  # the target's decode kernels (not fp32): the whole round replays
        assert rounds, "the whole round (the head's chain and the target's verification) was not captured"
    assert generate(decoder, method, k) == plain  # replayed again by a later generation
    assert captured_chains(head, k) == chains
    decoder.set_cuda_graphs(False)
    try:
        assert not head.runner.use_graphs
        assert generate(decoder, method, k) == plain  # the eager chain: the same tokens
    finally:
        decoder.set_cuda_graphs(True)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trees_stay_lossless_with_graphs_on(target_dir, tmp_path, layout, dtype):
    """A tree's growth and its whole round take their graph paths: greedy output still equals plain
    decoding."""
    decoder, method, _ = decoder_on_cuda(target_dir, tmp_path, layout, dtype)
    plain = generate(decoder, "none", 1)
    for k in (1, 4):
        assert generate(decoder, method, k, nodes=6) == plain
        assert generate(decoder, method, k) == plain


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_heads_step_on_the_decode_kernels_matches_its_torch_step(target_dir, tmp_path, layout):
    """In bf16 a head's block step runs on the target's decode kernels: its features, logits and cache rows
    match the layer's torch operations within bf16 rounding, and a step that only torch can take (fp32)
    keeps them."""
    decoder, _, head = decoder_on_cuda(target_dir, tmp_path, layout, torch.bfloat16)
    layer = head.runner
    n, start = 3, 6
    assert layer.kernels_for(n) is decoder.target.decode_kernels is not None
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, layer.w["qkv"].shape[1], generator=g, device="cuda").to(torch.bfloat16)
    layer.kv.copy_(torch.randn(layer.kv.shape, generator=g, device="cuda"))  # the rows before start
    before = layer.kv.clone()
    begin = torch.tensor([start], device="cuda")
    depth, visible = layer.chain_block(n)
    fused = layer.block_step(x, begin, depth, visible, 0)
    fused_rows = layer.kv[:, :, start:start + n].clone()
    layer.kv.copy_(before)
    kernels = layer.step_kernels
    layer.use_torch_twins()
    try:
        assert layer.kernels_for(n) is None
        eager = layer.block_step(x, begin, depth, visible, 0)
    finally:
        layer.step_kernels = kernels
    for got, want in ((fused[0], eager[0]), (fused_rows, layer.kv[:, :, start:start + n])):
        assert (got.float() - want.float()).abs().max() <= 0.05 * want.float().abs().max() + 0.02
    finite = eager[1].isfinite()
    assert torch.equal(finite, fused[1].isfinite())  # the draft vocabulary's mapping
    assert (fused[1][finite] - eager[1][finite]).abs().max() <= 0.05 * eager[1][finite].abs().max() + 0.05
