"""The published EAGLE-1 and EAGLE-3 heads on CUDA (fp32 and bf16): their K-step draft chains are captured as
one CUDA graph each (engine.methods.eagle.graphs.eagle_chain over HeadLayer.block_step), greedy output equals
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


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [2, 5])
def test_chain_is_captured_and_greedy_equals_plain(target_dir, tmp_path, layout, dtype, k):
    decoder, method, head = decoder_on_cuda(target_dir, tmp_path, layout, dtype)
    assert head.runner.use_graphs and ChainGraphs.available(head.runner, k)
    plain = generate(decoder, "none", 0)
    assert generate(decoder, method, k) == plain
    chains = [key for key in ChainGraphs.of(head.runner)._graphs if key[:2] == ("eagle", k)]
    assert len(ChainGraphs.of(head.runner)) > 0 and chains, "the head's chain was not captured"
    assert generate(decoder, method, k) == plain  # replayed again by a later generation
    assert [key for key in ChainGraphs.of(head.runner)._graphs if key[:2] == ("eagle", k)] == chains
    decoder.set_cuda_graphs(False)
    try:
        assert not head.runner.use_graphs
        assert generate(decoder, method, k) == plain  # the eager chain: the same tokens
    finally:
        decoder.set_cuda_graphs(True)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trees_stay_lossless_with_graphs_on(target_dir, tmp_path, layout, dtype):
    """The whole-round graphs do not apply to these heads (no decode path); a tree's growth takes the
    growth's graph path: greedy output still equals plain decoding."""
    decoder, method, _ = decoder_on_cuda(target_dir, tmp_path, layout, dtype)
    plain = generate(decoder, "none", 0)
    for k in (1, 4):
        assert generate(decoder, method, k, nodes=6) == plain
        assert generate(decoder, method, k) == plain
