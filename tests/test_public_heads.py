"""Published head layouts (EAGLE-1/2, EAGLE-3 in three layouts, Medusa-1 and vLLM's Medusa) built with random
weights in their exact names, shapes and configs: lossless (greedy and chi-squared), each forward against a
reference written here from the published definition, and misfits refused in one line."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tiny_models import make_tiny_llama

from engine.analysis.lossless import check_greedy, check_sampling
from engine.config import GenerationConfig, SamplingParams
from engine.core.decoder import SpeculativeDecoder
from engine.errors import SpecplayError
from engine.models.loading import load_pair

HIDDEN, VOCAB, LAYERS, HEADS, KV_HEADS, INTER = 32, 40, 6, 4, 2, 48
PROMPT = "the cat sat on the mat. the cat"


def _randn(gen, *shape, scale=0.2):
    return scale * torch.randn(*shape, generator=gen)


def _llama_layer(gen, prefix, inputs, with_input_norm):
    d = HIDDEN // HEADS
    t = {f"{prefix}self_attn.q_proj.weight": _randn(gen, HEADS * d, inputs),
         f"{prefix}self_attn.k_proj.weight": _randn(gen, KV_HEADS * d, inputs),
         f"{prefix}self_attn.v_proj.weight": _randn(gen, KV_HEADS * d, inputs),
         f"{prefix}self_attn.o_proj.weight": _randn(gen, HIDDEN, HEADS * d),
         f"{prefix}mlp.gate_proj.weight": _randn(gen, INTER, HIDDEN),
         f"{prefix}mlp.up_proj.weight": _randn(gen, INTER, HIDDEN),
         f"{prefix}mlp.down_proj.weight": _randn(gen, HIDDEN, INTER),
         f"{prefix}post_attention_layernorm.weight": 1 + _randn(gen, HIDDEN, scale=0.1)}
    if with_input_norm:
        t[f"{prefix}input_layernorm.weight"] = 1 + _randn(gen, HIDDEN, scale=0.1)
    return t


def _layer_config():
    return {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "intermediate_size": INTER, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 256, "vocab_size": VOCAB, "num_hidden_layers": 1}


def make_eagle1(folder, seed=1, bin_file=False, bias=None):
    """SafeAILab's EAGLE layout: fc [H, 2H] (+ bias unless "bias": false), layers.0.* without an input norm."""
    gen = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    t = {"fc.weight": _randn(gen, HIDDEN, 2 * HIDDEN), **_llama_layer(gen, "layers.0.", HIDDEN, False)}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_layer_config()}
    if bias is False:
        config["bias"] = False
    else:
        t["fc.bias"] = _randn(gen, HIDDEN)
    (folder / "config.json").write_text(json.dumps(config))
    if bin_file:
        torch.save(t, folder / "pytorch_model.bin")
    else:
        save_file(t, str(folder / "model.safetensors"))
    return folder


def make_eagle3(folder, layout="specforge", seed=2, draft_vocab=24, taps=(1, 3, 4), before_residual=False):
    """EAGLE-3: SpecForge / vLLM (midlayer.*) or speculators (layers.0.*), a reduced vocabulary with d2t."""
    gen = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    prefix = "layers.0." if layout == "speculators" else "midlayer."
    t = {"fc.weight": _randn(gen, HIDDEN, 3 * HIDDEN), "norm.weight": 1 + _randn(gen, HIDDEN, scale=0.1),
         "lm_head.weight": _randn(gen, draft_vocab, HIDDEN, scale=0.5),
         f"{prefix}hidden_norm.weight": 1 + _randn(gen, HIDDEN, scale=0.1),
         **_llama_layer(gen, prefix, 2 * HIDDEN, True)}
    chosen = torch.randperm(VOCAB, generator=gen)[:draft_vocab].sort().values  # the target ids it drafts
    t["d2t"] = chosen - torch.arange(draft_vocab)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[chosen] = True
    t["t2d"] = t2d
    layer = _layer_config()
    if layout == "speculators":
        t["fc.bias"] = _randn(gen, HIDDEN)
        config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                  "transformer_layer_config": {"model_type": "llama", **layer}, "draft_vocab_size": draft_vocab,
                  "norm_before_residual": before_residual, "eagle_aux_hidden_state_layer_ids": list(taps),
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy",
                                                               "speculative_tokens": 3}],
                                         "verifier": {"name_or_path": "tiny/target",
                                                      "architectures": ["LlamaForCausalLM"]}}}
    else:
        arch = "LlamaForCausalLMEagle3" if layout == "specforge" else "Eagle3LlamaForCausalLM"
        config = {"architectures": [arch], "model_type": "llama", **layer, "draft_vocab_size": draft_vocab,
                  "norm_before_residual": before_residual,
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(taps)}}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(t, str(folder / "model.safetensors"))
    return folder


def make_medusa(folder, layout="medusa1", heads=3, layers=1, seed=3, pt_file=False):
    """FasterDecoding's Medusa-1 ({h}.{l}.linear.*, {h}.{L}.weight) or vLLM's (blocks.*, lm_heads.*)."""
    gen = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    t = {}
    for h in range(heads):
        for b in range(layers):
            name = f"{h}.{b}.linear." if layout == "medusa1" else f"blocks.{h}.layers.{b}."
            t[name + "weight"], t[name + "bias"] = _randn(gen, HIDDEN, HIDDEN, scale=0.3), _randn(gen, HIDDEN)
        t[f"{h}.{layers}.weight" if layout == "medusa1" else f"lm_heads.{h}.weight"] = _randn(gen, VOCAB, HIDDEN,
                                                                                              scale=0.5)
    if layout == "medusa1":
        config = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": "tiny"}
        if pt_file:
            torch.save(t, folder / "medusa_lm_head.pt")
        else:
            save_file(t, str(folder / "medusa_lm_head.safetensors"))
    else:
        config = {"model_type": "medusa", "num_heads": heads, "num_hidden_layers": layers, "hidden_size": HIDDEN,
                  "vocab_size": VOCAB}
        save_file(t, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("public")
    return make_tiny_llama(root / "target", vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, heads=HEADS,
                           kv_heads=KV_HEADS, seed=5, std=0.3)


def decoder_with(target_dir, heads_dir):
    decoder = SpeculativeDecoder(load_pair(str(target_dir), None, device="cpu", need_draft=False))
    decoder.use_heads(str(heads_dir))
    return decoder


LAYOUTS = {
    "eagle1": lambda d: make_eagle1(d), "eagle1-bin-nobias": lambda d: make_eagle1(d, bin_file=True, bias=False),
    "eagle3-specforge": lambda d: make_eagle3(d), "eagle3-vllm": lambda d: make_eagle3(d, "vllm"),
    "eagle3-speculators": lambda d: make_eagle3(d, "speculators", before_residual=True),
    "medusa1": lambda d: make_medusa(d), "medusa1-pt-2layers": lambda d: make_medusa(d, layers=2, pt_file=True),
    "medusa-vllm": lambda d: make_medusa(d, "vllm"),
}
METHOD = {"eagle1": "eagle", "eagle3": "eagle3", "medusa": "medusa"}


def method_of(layout):
    return next(m for prefix, m in METHOD.items() if layout.startswith(prefix))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_greedy_output_equals_plain_decoding(target_dir, tmp_path, layout):
    decoder = decoder_with(target_dir, LAYOUTS[layout](tmp_path / layout))
    method = method_of(layout)
    specs = [(method, 0)] + ([("medusa-fixed", 0)] if method == "medusa" else [(method, 6)])
    for name, nodes in specs:
        config = GenerationConfig(method=name, k=3, tree_nodes=nodes, max_new_tokens=24, stop_at_eos=False)
        report = check_greedy(decoder, PROMPT, config)
        assert report.passed, (layout, name, report)
        events = list(decoder.generate(PROMPT, config))
        assert sum(len(e.drafted) for e in events) > 0


@pytest.mark.parametrize("layout", ["eagle1", "eagle3-speculators", "medusa1"])
def test_sampling_is_lossless(target_dir, tmp_path, layout):
    decoder = decoder_with(target_dir, LAYOUTS[layout](tmp_path / layout))
    config = GenerationConfig(method=method_of(layout), k=3, sampling=SamplingParams(0.9, 0, 1.0), seed=300)
    report = check_sampling(decoder, "a cat", config, samples=500)
    assert report.bins >= 8 and report.passed, report
