"""Random-weight model pairs of real shapes, for timing only: study an 8B layer stack without its weights.

The target is a transformers `LlamaForCausalLM` (`Qwen3ForCausalLM` for the qwen3 shapes, which run on the
Llama-family runner's fast path too) made directly on the device with random weights; the draft is
its first few layers with the same embeddings, final norm and LM head (no extra memory). Scaling the later
layers' output projections (o_proj, down_proj) by `damping` makes the target stay close to its first layers,
so the draft agrees with it often enough to give speculation something to accept (0.02 gave ~3.2 tokens per
forward at K = 4 on the 7B shape). Nothing is written to disk. The text these pairs produce means nothing.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional

import torch

from engine.errors import SpecplayError

# Shapes of real models (the layer stack that decides the step time); vocabularies as released.
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),  # for tests on the CPU
    "llama-1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                     num_key_value_heads=4, vocab_size=32000),  # TinyLlama-1.1B
    "llama-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                     num_key_value_heads=8, vocab_size=128256),  # Llama-3.2-3B
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000),  # Llama-2-7B
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),  # Llama-3.1-8B
    # Qwen3 as published (per-head q_norm / k_norm, head_dim 128, the small ones with tied embeddings)
    "qwen3-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=True,
                       rope_theta=1000000.0, rms_norm_eps=1e-6),  # for tests on the CPU
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                       rope_theta=1000000.0, rms_norm_eps=1e-6),  # Qwen3-1.7B
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                     rope_theta=1000000.0, rms_norm_eps=1e-6),  # Qwen3-4B
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
                     rms_norm_eps=1e-6),  # Qwen3-8B
}
LLAMA_DEFAULTS = dict(rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
DRAFT_LAYERS = 2
DAMPING = 0.02


@dataclass
class SyntheticPair:
    """Our ModelPair plus the transformers models it was built from (for `bench runtimes`)."""

    pair: Any  # engine.models.loading.ModelPair
    hf_target: Any  # LlamaForCausalLM (Qwen3ForCausalLM for the qwen3 shapes)
    hf_draft: Any  # the same class, sharing the target's first layers
    shape: str


class SyntheticTokenizer:
    """Encodes prompts with a real tokenizer (ids below its size) and decodes any id of the synthetic
    vocabulary; no EOS, so every generation runs to its token budget."""

    eos_token_id = None

    def __init__(self, base, vocab_size: int):
        self.base = base
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list:
        return [i for i in self.base.encode(text, add_special_tokens=False) if i < self.vocab_size]

    def decode(self, ids, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False) -> str:
        known = len(self.base)
        return "".join(self.base.decode([i], skip_special_tokens=skip_special_tokens) if i < known else "·"
                       for i in ids)


def shape_names() -> tuple:
    return tuple(SHAPES)


def check_shape(shape: str) -> None:
    """A shape this module does not know is refused before anything is built or announced."""
    if shape not in SHAPES:
        raise SpecplayError(f"unknown synthetic shape {shape!r}; choose one of: {', '.join(SHAPES)}")


def is_qwen3(shape: str) -> bool:
    return shape.startswith("qwen3")


def model_config(shape: str, layers: Optional[int] = None, max_position: int = 4096):
    """The transformers config of `shape` (Qwen3Config for the qwen3 shapes, else LlamaConfig)."""
    import transformers

    check_shape(shape)
    fields = {**LLAMA_DEFAULTS, **SHAPES[shape]}
    if layers is not None:
        fields["num_hidden_layers"] = layers
    if is_qwen3(shape) and not hasattr(transformers, "Qwen3Config"):
        raise SpecplayError(f"synthetic {shape}: transformers {transformers.__version__} has no Qwen3 "
                            "(Qwen3Config); a newer release does")
    kind = transformers.Qwen3Config if is_qwen3(shape) else transformers.LlamaConfig
    return kind(**fields, max_position_embeddings=max_position, bos_token_id=None, eos_token_id=None,
                pad_token_id=None)


def _causal_lm(shape: str):
    import transformers

    return transformers.Qwen3ForCausalLM if is_qwen3(shape) else transformers.LlamaForCausalLM


def build_synthetic_pair(shape: str, device, dtype: torch.dtype, max_length: int = 2048, seed: int = 0,
                         draft_layers: int = DRAFT_LAYERS, damping: float = DAMPING) -> SyntheticPair:
    """A random-weight target of `shape` and its first `draft_layers` layers as the draft, on `device`."""
    from engine.models.llama import LlamaRunner, LlamaSpec
    from engine.models.loading import ModelPair, load_tokenizer, shipped_pair

    config = model_config(shape, max_position=max_length)
    model_class = _causal_lm(shape)
    torch.manual_seed(seed)
    with _default_device(device):
        target = model_class(config).to(dtype).eval()
        draft = model_class(model_config(shape, layers=draft_layers, max_position=max_length))
        draft = draft.to(dtype).eval()
    _damp_later_layers(target, draft_layers, damping)
    _share_first_layers(draft, target, draft_layers)
    spec_t = LlamaSpec.from_dict(target.config.to_dict())
    spec_d = LlamaSpec.from_dict(draft.config.to_dict())
    runner_t = LlamaRunner(spec_t, dict(target.state_dict()), device=device, dtype=dtype,
                           max_length=max_length, path=f"synthetic:{shape}")
    runner_d = LlamaRunner(spec_d, dict(draft.state_dict()), device=device, dtype=dtype,
                           max_length=max_length, path=f"synthetic:{shape}:draft")
    tokenizer = SyntheticTokenizer(load_tokenizer(shipped_pair()[0]), config.vocab_size)
    pair = ModelPair(runner_t, runner_d, tokenizer, f"synthetic:{shape}",
                     f"synthetic:{shape}:{draft_layers}L", config.vocab_size)
    return SyntheticPair(pair, target, draft, shape)


@contextlib.contextmanager
def _default_device(device):
    """Make parameters directly on the device (a 7B model built on the CPU first would take minutes)."""
    with torch.device(device), torch.no_grad():
        yield


@torch.no_grad()
def _damp_later_layers(model, keep: int, damping: float) -> None:
    for layer in model.model.layers[keep:]:
        layer.self_attn.o_proj.weight.mul_(damping)
        layer.mlp.down_proj.weight.mul_(damping)


def _share_first_layers(draft, target, layers: int) -> None:
    """The draft's modules become the target's own: embeddings, its first layers, final norm and head."""
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.layers = torch.nn.ModuleList(target.model.layers[:layers])
    draft.model.norm = target.model.norm
    draft.lm_head = target.lm_head
    if hasattr(draft.model, "rotary_emb") and hasattr(target.model, "rotary_emb"):
        draft.model.rotary_emb = target.model.rotary_emb


def cache_bytes_per_row(runner) -> int:
    """Bytes of one token's keys and values in the cache, every layer (what attention reads a cached row)."""
    spec = runner.spec
    return len(runner.layers) * 2 * spec.num_kv_heads * spec.head_dim * (torch.finfo(runner.dtype).bits // 8)


def weight_bytes_per_step(runner) -> int:
    """Bytes of weights one decode step reads: every layer's matrices and norms, the final norm and the LM
    head (the embedding is read one row per token and is left out unless it is the tied head)."""
    total = sum(t.numel() * t.element_size() for layer in runner.layers for t in vars(layer).values()
                if t is not None)
    total += runner.norm_weight.numel() * runner.norm_weight.element_size()
    return total + runner.lm_head.numel() * runner.lm_head.element_size()

