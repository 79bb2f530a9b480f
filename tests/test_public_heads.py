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
    """SafeAILab's EAGLE layout: fc [H, 2H] (+ bias unless "bias": false), layers.0.* without an input
    norm."""
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
                  "transformer_layer_config": {"model_type": "llama", **layer},
                  "draft_vocab_size": draft_vocab,
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
        lm_head = f"{h}.{layers}.weight" if layout == "medusa1" else f"lm_heads.{h}.weight"
        t[lm_head] = _randn(gen, VOCAB, HIDDEN, scale=0.5)
    if layout == "medusa1":
        config = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": "tiny"}
        if pt_file:
            torch.save(t, folder / "medusa_lm_head.pt")
        else:
            save_file(t, str(folder / "medusa_lm_head.safetensors"))
    else:
        config = {"model_type": "medusa", "num_heads": heads, "num_hidden_layers": layers,
                  "hidden_size": HIDDEN, "vocab_size": VOCAB}
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
    "eagle1": lambda d: make_eagle1(d),
    "eagle1-bin-nobias": lambda d: make_eagle1(d, bin_file=True, bias=False),
    "eagle3-specforge": lambda d: make_eagle3(d), "eagle3-vllm": lambda d: make_eagle3(d, "vllm"),
    "eagle3-speculators": lambda d: make_eagle3(d, "speculators", before_residual=True),
    "medusa1": lambda d: make_medusa(d),
    "medusa1-pt-2layers": lambda d: make_medusa(d, layers=2, pt_file=True),
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


@pytest.mark.slow  # a statistical check: `make test-fast` skips it
@pytest.mark.parametrize("layout", ["eagle1", "eagle3-speculators", "medusa1"])
def test_sampling_is_lossless(target_dir, tmp_path, layout):
    decoder = decoder_with(target_dir, LAYOUTS[layout](tmp_path / layout))
    config = GenerationConfig(method=method_of(layout), k=3, sampling=SamplingParams(0.9, 0, 1.0), seed=300)
    report = check_sampling(decoder, "a cat", config, samples=400)
    assert report.bins >= 8 and report.passed, report


# ------------------------------------------------------------------------------------------------------------
# each forward against a reference written from the published definition (transformers' hidden states, the
# published layer in plain torch here)


def _rms_ref(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_ref(x, positions):
    """x [n, heads, D]; HF's rotate_half convention, theta 10000."""
    d = x.shape[-1]
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    angles = positions[:, None].float() * inv[None]  # [n, D/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rotated * sin


def _layer_ref(t, prefix, attn_in, residual):
    """The published Llama layer over a whole causal sequence from position 0: attention of attn_in, the
    residual added, then post_attention_layernorm + SwiGLU MLP with its residual."""
    n, d = attn_in.shape[0], HIDDEN // HEADS
    q = (attn_in @ t[prefix + "self_attn.q_proj.weight"].T).view(n, HEADS, d)
    k = (attn_in @ t[prefix + "self_attn.k_proj.weight"].T).view(n, KV_HEADS, d)
    v = (attn_in @ t[prefix + "self_attn.v_proj.weight"].T).view(n, KV_HEADS, d)
    pos = torch.arange(n)
    q, k = _rope_ref(q, pos), _rope_ref(k, pos)
    k, v = (z.repeat_interleave(HEADS // KV_HEADS, 1) for z in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, HIDDEN)
    h = residual + attn @ t[prefix + "self_attn.o_proj.weight"].T
    x = _rms_ref(h, t[prefix + "post_attention_layernorm.weight"])
    mlp = (F.silu(x @ t[prefix + "mlp.gate_proj.weight"].T) * (x @ t[prefix + "mlp.up_proj.weight"].T))
    return h + mlp @ t[prefix + "mlp.down_proj.weight"].T


def _hf_states(target_dir, ids):
    from tiny_models import load_hf_reference

    with torch.no_grad():
        out = load_hf_reference(target_dir)(torch.tensor([ids]), output_hidden_states=True)
    return [h[0] for h in out.hidden_states], load_hf_reference(target_dir)


def _product_head_logits(decoder, head, ids):
    """The product's first draft logits after feeding the prompt's features (its own code path)."""
    target = decoder.target
    target.reset()
    target.tap_layers = getattr(head, "tap_layers", ())
    out = target.forward(torch.tensor(ids[:-1]))
    features = out.hidden if out.taps is None else out.taps
    head.runner.reset()
    x = head.fuse(head.true_features(features), torch.tensor(ids[1:]))
    return head.runner.forward_embeds(x).logits[-1]


IDS = [5, 9, 14, 3, 22, 9, 30, 7]


@pytest.mark.parametrize("layout", ["eagle1", "eagle1-bin-nobias"])
def test_eagle1_forward_matches_the_published_definition(target_dir, tmp_path, layout):
    from safetensors.torch import load_file

    folder = LAYOUTS[layout](tmp_path / layout)
    decoder = decoder_with(target_dir, folder)
    files = list(folder.glob("*.safetensors"))
    t = load_file(str(files[0])) if files else torch.load(folder / "pytorch_model.bin", weights_only=True)
    states, hf = _hf_states(target_dir, IDS[:-1])
    f = states[-1]  # after the target's final norm
    embeds = hf.model.embed_tokens.weight[torch.tensor(IDS[1:])].detach()
    x = torch.cat([embeds, f], -1) @ t["fc.weight"].T + t.get("fc.bias", torch.zeros(HIDDEN))
    h = _layer_ref(t, "layers.0.", x, x)  # layer 0: no input norm
    reference = h[-1] @ hf.lm_head.weight.detach().T
    got = _product_head_logits(decoder, decoder.eagle_head(), IDS)
    assert torch.allclose(got, reference, atol=1e-4), (got - reference).abs().max()


@pytest.mark.parametrize("layout", ["eagle3-specforge", "eagle3-vllm", "eagle3-speculators"])
def test_eagle3_forward_matches_the_published_definition(target_dir, tmp_path, layout):
    from safetensors.torch import load_file

    folder = LAYOUTS[layout](tmp_path / layout)
    decoder = decoder_with(target_dir, folder)
    t = load_file(str(folder / "model.safetensors"))
    prefix = "layers.0." if layout.endswith("speculators") else "midlayer."
    states, hf = _hf_states(target_dir, IDS[:-1])
    taps = torch.cat([states[k] for k in (1, 3, 4)], -1)  # hidden_states[k]: before layer k
    g = taps @ t["fc.weight"].T + t.get("fc.bias", torch.zeros(HIDDEN))
    embeds = hf.model.embed_tokens.weight[torch.tensor(IDS[1:])].detach()
    normed = _rms_ref(g, t[prefix + "hidden_norm.weight"])
    residual = normed if layout.endswith("speculators") else g  # the speculators head: norm_before_residual
    attn_in = torch.cat([_rms_ref(embeds, t[prefix + "input_layernorm.weight"]), normed], -1)
    h = _layer_ref(t, prefix, attn_in, residual)
    draft_logits = _rms_ref(h[-1], t["norm.weight"]) @ t["lm_head.weight"].T  # [draft vocab]
    target_ids = torch.arange(len(t["d2t"])) + t["d2t"]
    got = _product_head_logits(decoder, decoder.eagle3_head(), IDS)
    assert torch.allclose(got[target_ids], draft_logits, atol=1e-4), (got[target_ids] - draft_logits).abs()
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[target_ids] = False
    assert torch.isneginf(got[outside]).all() and bool(t["t2d"][target_ids].all())


@pytest.mark.parametrize("layout", ["medusa1", "medusa1-pt-2layers", "medusa-vllm"])
def test_medusa_forward_matches_the_published_definition(target_dir, tmp_path, layout):
    folder = LAYOUTS[layout](tmp_path / layout)
    decoder = decoder_with(target_dir, folder)
    pt = folder / "medusa_lm_head.pt"
    if pt.exists():
        t = torch.load(pt, weights_only=True)
    else:
        from safetensors.torch import load_file

        t = load_file(str(next(folder.glob("*.safetensors"))))
    states, _ = _hf_states(target_dir, IDS)
    layers = 2 if "2layers" in layout else 1
    references = []
    for h in range(3):
        x = states[-1][-1]  # the last position, after the final norm
        for b in range(layers):
            name = f"{h}.{b}.linear." if layout.startswith("medusa1") else f"blocks.{h}.layers.{b}."
            x = x + F.silu(x @ t[name + "weight"].T + t[name + "bias"])
        lm_head = f"{h}.{layers}.weight" if layout.startswith("medusa1") else f"lm_heads.{h}.weight"
        references.append(x @ t[lm_head].T)
    target = decoder.target
    target.reset()
    raw = target.forward(torch.tensor(IDS)).hidden[-1]  # before the final norm: the heads norm it
    got = decoder.medusa_heads().logits(target, raw)
    assert torch.allclose(got, torch.stack(references), atol=1e-4)


def test_medusa_fixed_tree_is_the_published_one(target_dir, tmp_path):
    from engine.methods.medusa.drafter import FixedTreeMedusaDrafter
    from engine.methods.medusa.public import MC_SIM_7B_63

    decoder = decoder_with(target_dir, make_medusa(tmp_path / "m", heads=4))
    drafter = FixedTreeMedusaDrafter(decoder.target, decoder.medusa_heads())
    tree, _ = drafter._tree(*drafter._shape(4))
    assert tree.size == 63 and len(MC_SIM_7B_63) == 63


# ------------------------------------------------------------------------------------------------------------
# misfits refused before allocation, in one line naming the field or tensor


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _drop_tensor(folder, name):
    from safetensors.torch import load_file

    t = load_file(str(folder / "model.safetensors"))
    t.pop(name)
    save_file(t, str(folder / "model.safetensors"))
    return folder


MISFITS = {
    "hidden size": (lambda d: _edit_config(make_eagle1(d), hidden_size=48), "hidden_size 48"),
    "vocabulary": (lambda d: _edit_config(make_eagle3(d), vocab_size=50), "vocab_size 50"),
    "tap past the last": (lambda d: _edit_config(make_eagle3(d), eagle_config={
        "eagle_aux_hidden_state_layer_ids": [1, 3, 6]}), "tapped layer 6"),
    "d2t out of range": (lambda d: _bad_d2t(make_eagle3(d)), "d2t[0]"),
    "missing key": (lambda d: _drop_tensor(make_eagle3(d, "vllm"), "midlayer.hidden_norm.weight"),
                    "midlayer.hidden_norm.weight missing"),
    "wrong shape": (lambda d: _edit_config(make_eagle3(d), draft_vocab_size=20), "lm_head.weight has shape"),
    "absurd config": (lambda d: _edit_config(make_medusa(d), medusa_num_heads=10 ** 6), "medusa_num_heads"),
    "medusa shapes": (lambda d: _edit_config(make_medusa(d, "vllm"), num_heads=4),
                      "blocks.3.layers.0.weight"),
    "unknown layout": (lambda d: _edit_config(make_eagle1(d), num_hidden_layers=2), "no known head layout"),
}


def _bad_d2t(folder):
    from safetensors.torch import load_file

    t = load_file(str(folder / "model.safetensors"))
    t["d2t"][0] = VOCAB + 5
    save_file(t, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("case", sorted(MISFITS))
def test_misfitting_heads_are_refused_in_one_line(target_dir, tmp_path, case):
    build, words = MISFITS[case]
    folder = build(tmp_path / case.replace(" ", "_"))
    decoder = SpeculativeDecoder(load_pair(str(target_dir), None, device="cpu", need_draft=False))
    with pytest.raises(SpecplayError) as caught:
        decoder.use_heads(str(folder))
    message = str(caught.value)
    assert words in message and "\n" not in message, message
    assert decoder.heads_info is None


def test_a_heads_layer_takes_the_decode_kernels_only_where_the_target_has_them(target_dir, tmp_path):
    """On the CPU (fp32) the target has no decode kernels and the head's layer runs torch's operations; a
    layer handed kernels still keeps torch in fp32, and the torch-twins switch takes them away (the bf16
    path is tests/test_public_heads_gpu.py's)."""
    decoder = decoder_with(target_dir, LAYOUTS["eagle3-speculators"](tmp_path / "eagle3"))
    layer = decoder.eagle3_head().runner
    assert decoder.target.decode_kernels is None and layer.step_kernels is None
    assert layer.kernels_for(1) is None
    layer.step_kernels = object()  # kernels of a GPU: fp32 weights are not theirs
    assert layer.kernels_for(1) is None
    layer.use_torch_twins()
    assert layer.step_kernels is None
