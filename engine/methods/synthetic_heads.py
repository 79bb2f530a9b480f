"""Random-weight draft heads of the published architectures, built in memory for timing only.

For a synthetic pair (engine.models.synthetic) or any Llama-family target: EAGLE-1/2 (SafeAILab's layout),
EAGLE-3 (SpecForge's, with a reduced draft vocabulary and its d2t mapping: 32,000 tokens where the target's
vocabulary is larger, as the public Llama-3.1-8B and Qwen3 EAGLE-3 heads have) and Medusa-1 (FasterDecoding's,
5 heads of one residual block, each with its own LM head). Each head's config is written as the published
one would be, its tensors' names and shapes come from the loaders' own expected-shape functions and are
checked by the loaders' check, and the head is made by the loaders' own from_tensors: what a GPU times is
what `--heads DIR` would run. Nothing is written to disk (an 8B-shape Medusa is gigabytes).

Weights are N(0, 1 / fan_in) (norms 1, biases 0), so activations and logits stay of order one and finite in
half precision; what they draft means nothing: acceptance comes from --synthetic-acceptance.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from engine.methods import public_heads as ph
from engine.models import validate

HEAD_METHODS = ("eagle", "eagle3", "medusa")  # the heads' methods; medusa-fixed runs medusa's heads
EAGLE3_DRAFT_VOCAB = 32000  # draft_vocab_size of the public Llama-3.1-8B and Qwen3 EAGLE-3 heads
TINY_DRAFT_SHARE = 4  # a target vocabulary of at most 32,000 maps a quarter of it (tests see the mapping)
MEDUSA_HEADS = 5  # medusa_num_heads of FasterDecoding's published Medusa-1 heads
LAYOUTS = {"eagle": "EAGLE-1/2 (SafeAILab)", "eagle3": "EAGLE-3 (SpecForge)",
           "medusa": "Medusa-1 (FasterDecoding)"}


@dataclass
class SyntheticHead:
    """One built head: its published-style description, its tensors under the published names (d2t too)
    and the head object the drafters run."""

    info: ph.HeadsInfo
    tensors: dict
    head: object


def head_method(name: str) -> Optional[str]:
    """The head method a registry method runs (medusa-fixed -> medusa), None for a method without heads."""
    name = "medusa" if name == "medusa-fixed" else name
    return name if name in HEAD_METHODS else None


def draft_vocab_size(vocab: int) -> int:
    """The EAGLE-3 head's draft vocabulary for a target vocabulary."""
    return EAGLE3_DRAFT_VOCAB if vocab > EAGLE3_DRAFT_VOCAB else max(1, vocab // TINY_DRAFT_SHARE)


def layer_config(target) -> dict:
    """The head layer's Llama config: the target's layer (the published heads copy it), one layer."""
    s = target.spec
    return {"hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
            "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads, "head_dim": s.head_dim,
            "rms_norm_eps": s.rms_norm_eps, "rope_theta": s.rope_theta,
            "max_position_embeddings": s.max_position_embeddings, "vocab_size": s.vocab_size,
            "num_hidden_layers": 1}


def head_info(method: str, target, name: str) -> ph.HeadsInfo:
    """The HeadsInfo a published folder of this head would give (its config as written there)."""
    folder = Path(f"synthetic:{name}:{method}")
    layer = layer_config(target)
    if method == "eagle":
        config = {**layer, "architectures": ["LlamaForCausalLM"], "bias": True}
        return ph.HeadsInfo(folder, LAYOUTS[method], method, config, folder / "model.safetensors", name)
    if method == "eagle3":
        layers = target.spec.num_layers
        taps = (2, layers // 2, layers - 3)  # the published default
        vocab = draft_vocab_size(target.vocab_size)
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": vocab,
                  "target_hidden_size": target.hidden_size, "eagle_aux_hidden_state_layer_ids": list(taps)}
        return ph.HeadsInfo(folder, LAYOUTS[method], method, config, folder / "model.safetensors", name, taps,
                            vocab)
    config = {"medusa_num_heads": MEDUSA_HEADS, "medusa_num_layers": 1, "hidden_size": target.hidden_size,
              "vocab_size": target.vocab_size}
    return ph.HeadsInfo(folder, LAYOUTS[method], method, config, folder / "medusa_lm_head.safetensors", name)


def expected_shapes(info: ph.HeadsInfo, target) -> dict:
    """name -> shape of every tensor the head's loader reads (its own expected-shape function)."""
    if info.method == "eagle":
        from engine.methods.eagle import public as eagle_public

        return eagle_public.expected_shapes(info, target)[0]
    if info.method == "eagle3":
        from engine.methods.eagle3 import public as eagle3_public

        return eagle3_public.expected(info, target)[0]
    from engine.methods.medusa import public as medusa_public

    return medusa_public.expected_shapes(info, target)


def random_tensors(shapes: dict, device, dtype, generator: torch.Generator) -> dict:
    """Matrices N(0, 1 / fan_in), norm weights 1, biases 0: made directly on the device in dtype."""
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            fill = torch.zeros if name.endswith("bias") else torch.ones
            out[name] = fill(shape, device=device, dtype=dtype)
        else:
            weight = torch.randn(shape, generator=generator, device=device, dtype=dtype)
            out[name] = weight.mul_(shape[-1] ** -0.5)
    return out


def draft_ids(vocab: int, draft_vocab: int, seed: int) -> Optional[torch.Tensor]:
    """A draft vocabulary's target ids [Vd] (a sorted random subset; None: the whole vocabulary), its d2t
    checked as the loader checks a published one."""
    if draft_vocab == vocab:
        return None
    from engine.methods.eagle3.public import check_d2t

    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values
    check_d2t(ids - torch.arange(draft_vocab), vocab, "the synthetic EAGLE-3 head's d2t")
    return ids


def build_head(method: str, target, name: str, seed: int = 0) -> SyntheticHead:
    """One random-weight head of `method` (eagle, eagle3 or medusa) for the target, on its device."""
    info = head_info(method, target, name)
    shapes = expected_shapes(info, target)
    generator = torch.Generator(device=target.device).manual_seed(seed)
    tensors = random_tensors(shapes, target.device, target.dtype, generator)
    header = {key: validate.TensorInfo(tuple(t.shape), ph._st_dtype(t.dtype), info.weights)
              for key, t in tensors.items()}
    ph.check_shapes(header, shapes, info.weights, f"synthetic {LAYOUTS[method]} head")
    return SyntheticHead(info, tensors, _head(info, tensors, target, seed))


def _head(info: ph.HeadsInfo, tensors: dict, target, seed: int):
    if info.method == "eagle":
        from engine.methods.eagle import public as eagle_public

        _, shape, _, inv_freq = eagle_public.expected_shapes(info, target)
        return eagle_public.PublicEagleHead.from_tensors(tensors, shape, inv_freq, target)
    if info.method == "eagle3":
        from engine.methods.eagle3.public import PublicEagle3Head

        ids = draft_ids(target.vocab_size, info.draft_vocab, seed)
        if ids is not None:
            tensors["d2t"] = ids - torch.arange(len(ids))  # as the published file holds it (on the host)
            ids = ids.to(target.device)
        return PublicEagle3Head.from_tensors(info, tensors, ids, target)
    from engine.methods.medusa import public as medusa_public

    return medusa_public.from_tensors(info, tensors)


def build_heads(target, name: str, method_names, seed: int = 0) -> dict:
    """head method -> SyntheticHead for every head method the registry methods named need, in their order."""
    wanted = dict.fromkeys(m for m in map(head_method, method_names) if m is not None)
    return {method: build_head(method, target, name, seed + i) for i, method in enumerate(wanted)}


def describe(heads: dict) -> str:
    """One line a head: its layout, its size and what sets it."""
    return "\n".join(_line(method, built) for method, built in heads.items())


def _line(method: str, built: SyntheticHead) -> str:
    params = sum(t.numel() for key, t in built.tensors.items() if key != "d2t")
    line = f"synthetic {method} head: {built.info.layout}, {params / 1e6:.1f}M random weights"
    if method == "eagle3":
        return line + f", draft vocabulary {built.info.draft_vocab} tokens, taps {list(built.info.taps)}"
    if method == "medusa":
        return line + f", {MEDUSA_HEADS} heads with their own LM heads"
    return line


def batch_eagle_head(target, seed: int = 0):
    """A random-weight EAGLE head in the project's own layout at the target's shape: fc [H, 2H] over
    [feature ; embedding], then one Llama layer of the target's shape sharing its final norm and LM head.
    Batched decoding drafts EAGLE with this layout only (engine.methods.eagle.batch runs a LlamaRunner layer
    over its batched cache, not the published heads' HeadLayer); its step reads what the published EAGLE-1
    head's does (the same products), so `bench batch --synthetic SHAPE --method eagle` times EAGLE's chain at
    the shape."""
    from dataclasses import replace

    from engine.methods.eagle.drafter import EagleHead
    from engine.models.llama import LlamaRunner

    s, hidden = target.spec, target.hidden_size
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    inter, layer = s.intermediate_size, "model.layers.0."
    shapes = {"self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
              "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, q),
              "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
              "mlp.down_proj.weight": (hidden, inter), "input_layernorm.weight": (hidden,),
              "post_attention_layernorm.weight": (hidden,)}
    shapes = {**{layer + name: shape for name, shape in shapes.items()}, "fc.weight": (hidden, 2 * hidden)}
    generator = torch.Generator(device=target.device).manual_seed(seed)
    tensors = random_tensors(shapes, target.device, target.dtype, generator)
    fc = tensors.pop("fc.weight")
    tensors.update({"model.embed_tokens.weight": target.embed_weight, "model.norm.weight": target.norm_weight,
                    "lm_head.weight": target.lm_head})
    spec = replace(s, num_layers=1, tie_word_embeddings=False, attention_bias=False, o_bias=False,
                   mlp_bias=False, sliding_window=None, sliding_layers=(), qk_norm=False)
    runner = LlamaRunner(spec, tensors, device=target.device, dtype=target.dtype,
                         max_length=target.max_length, path="synthetic EAGLE head (the project's layout)")
    return EagleHead(fc, runner, target)
