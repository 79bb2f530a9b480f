"""A compact forward for Llama-family causal LMs (Llama, Qwen2, Qwen3, Mistral) over a static KV cache.

Why our own forward: the decoder needs tree blocks (an additive tree mask, positions = length + depth), cheap
rollback (moving an integer), compaction of accepted tree paths, and a step whose tensors have fixed shapes so
that it is captured in a CUDA graph on GPU (CapturedStep). transformers' generic forward offers none of that
cheaply.

Weights are read straight from the checkpoint's safetensors; config.json is read as plain JSON so that both
the transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`) spellings are understood.

Cache layout: one buffer `kv` of shape [layers, 2, kv_heads, max_length, head_dim] (index 0 = keys,
1 = values); row r of the cache holds the token at cache index r. Keys are stored after the rotary embedding.

Qwen3 normalises each head of q and k (RMSNorm over head_dim, `q_norm` / `k_norm` [head_dim]) after the
projection and before the rotary embedding: `norm_heads` does it on every path, before the rope (the fused
rope kernel reads the normalised q and k).

Sliding-window attention (Mistral, Qwen2 and Qwen3 with use_sliding_window): the cache stays full-length
and a second mask hides, for the layers that use the window, every key whose position is `window` or more
before the query's. Models without a window (or with one at least as long as the cache) run exactly the
full-attention path.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from engine.errors import SpecplayError
from engine.kernels.step import ATTENTION_MAX_D, HALF_DTYPES, StepKernels, gemv_fits
from engine.models import validate
from engine.models.runner import (
    CausalRunner,
    ForwardOutput,
    captured,
    fill_unknown,
    graph_capture,
    to_device,
    tree_ancestor_mask,
    tree_depths,
    warm_up_stream,
)

LLAMA_FAMILY = frozenset({"llama", "qwen2", "qwen3", "mistral"})
QK_NORM_FAMILY = frozenset({"qwen3"})  # per-head RMSNorm of q and k before rope
QWEN3_DEFAULT_HEAD_DIM = 128  # transformers' Qwen3Config default when config.json is silent
DEFAULT_MAX_LENGTH = 4096
GRAPH_MAX_BLOCK = 64  # longer blocks run eagerly, but for a prefill's bucket of up to PREFILL_GRAPH_ROWS
# A prefill (a block at the cache's start) padded to a bucket of up to this many rows is captured: one graph
# per bucket serves every prompt length up to it. Eager, a 73-token prefill took 6.4 ms of host launches on
# the 1B shape (H200, docs/measurements/ttft_llama-1b_pdl1_eager_prefill.txt).
PREFILL_GRAPH_ROWS = 256
KV_BUCKET = 256  # on GPU, a step's attention width is rounded up to this many cache rows
MISTRAL_DEFAULT_WINDOW = QWEN2_DEFAULT_WINDOW = 4096  # transformers' defaults when config.json is silent
QWEN2_DEFAULT_WINDOW_LAYERS = 28
LLAMA_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads")
TREE_SHAPES_KEPT = 512  # tree masks kept on the device, by shape
GRAPH_LIMIT = 96  # captured steps kept per runner; past this, new shapes run eagerly
# Rows up to which the decode path multiplies with sp_gemv (norms and residuals fused in) rather than cuBLAS:
# one-token steps (plain decoding, the draft model's and EAGLE's steps). scripts/profile_step.py (removed; at
# tag before-house-cleanup) measures both
# for a block of K + 1 rows: sp_gemv turns compute-bound as rows grow, where cuBLAS does not. With whole
# rounds replayed, 8 rows were 2-6% faster on the shipped pair and no slower on the 1B and 7B shapes
# (docs/measurements/bench_gpu_gemv_rows_*_replays.txt). sp_gemv sums each row in the same order whatever
# the block's rows, so a bf16 block of up to 16 rows (a tree of 8 and Medusa's tree of 8 nodes among them)
# gets the products of one-token steps. A block takes sp_gemv only where every weight fits its staging
# (rows * K <= GEMV_STAGE: on a 1B shape, blocks of up to 3 rows).
DECODE_GEMV_ROWS = 16
# A draft tree's levels run on the decode kernels (LlamaRunner.step_tree_level); the cuBLAS paths' RMSNorms
# on sp_rms_norm (docs/measurements/e2e_batch_llama-8b_rms_norm.txt); the decode path's rope kernel adds the
# block's start to its depths and rows itself (two kernels fewer a step, the same bits).
# Blocks up to this many rows take the decode path (its attention kernel); longer ones, prefills of long
# prompts and trees, keep SDPA.
DECODE_ROWS = GRAPH_MAX_BLOCK
# Chain blocks of more rows than PAD_FROM_ROWS run padded to a bucket on CUDA (see block_bucket).
PAD_FROM_ROWS = 8
PAD_BUCKETS = (16, 32, 64)  # then multiples of the last


def block_bucket(n: int) -> int:
    """The rows a chain block of n runs as when padded: n itself up to PAD_FROM_ROWS (one-token steps and
    short verification blocks keep their own captured steps), then 16, 32, 64, then the next multiple of 64.

    Why: cuBLAS chooses an algorithm for every new row count (ms of host time the first time) and a captured
    step serves one row count, so an unpadded prefill of every new prompt length pays both; a few buckets
    see every prompt length."""
    if n <= PAD_FROM_ROWS:
        return n
    for bucket in PAD_BUCKETS:
        if n <= bucket:
            return bucket
    last = PAD_BUCKETS[-1]
    return -(-n // last) * last


def prefill_buckets() -> tuple:
    """The buckets a prefill runs as, up to PREFILL_GRAPH_ROWS: 16, 32, 64, then multiples of 64."""
    last = PAD_BUCKETS[-1]
    return PAD_BUCKETS + tuple(range(2 * last, PREFILL_GRAPH_ROWS + 1, last))


def is_bucket(rows: int) -> bool:
    """Whether a block of rows is a padded bucket (rows past PAD_FROM_ROWS that block_bucket keeps)."""
    return rows > PAD_FROM_ROWS and block_bucket(rows) == rows


class UnsupportedLlamaConfig(SpecplayError):
    """The config is Llama-family but uses a feature this compact forward does not implement.

    `engine.models.loading.load_runner` catches it and falls back to the generic `HFRunner`."""


def is_llama_family(config: Union[Mapping[str, Any], Any]) -> bool:
    """True for configs (a transformers config object or a config.json dict) that `LlamaRunner` can run."""
    if isinstance(config, Mapping):
        return config.get("model_type") in LLAMA_FAMILY
    return getattr(config, "model_type", None) in LLAMA_FAMILY


# ------------------------------------------------------------------------------------------------------------
# Config


@dataclass
class LlamaSpec:
    """The subset of config.json the forward needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope: Dict[str, Any]  # rope_type and its scaling parameters
    max_position_embeddings: int
    tie_word_embeddings: Optional[bool]  # None when config.json does not say
    attention_bias: bool  # bias on q/k/v
    o_bias: bool  # bias on o (Llama's attention_bias covers it, Qwen2 has none)
    mlp_bias: bool
    sliding_window: Optional[int]  # None when the model attends to the whole context
    sliding_layers: Tuple[bool, ...] = ()  # per layer: True when it attends through the sliding window
    qk_norm: bool = False  # Qwen3: q_norm / k_norm [head_dim] on each head of q and k before rope

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LlamaSpec":
        model_type = d.get("model_type")
        if model_type not in LLAMA_FAMILY:
            raise UnsupportedLlamaConfig(f"model_type {model_type!r} is not a Llama-family model")
        if d.get("quantization_config"):
            raise UnsupportedLlamaConfig("quantized checkpoints are not supported by the compact forward")
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedLlamaConfig(f"hidden_act {act!r} is not supported by the compact Llama forward")
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise SpecplayError(f"num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")
        layers = int(d["num_hidden_layers"])
        window, sliding_layers = _sliding_window(d, layers)
        rope = _rope_params(d)
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False  # Qwen2 always has q/k/v biases and no o bias
        else:  # Llama, Mistral and Qwen3: attention_bias covers q, k, v and o
            qkv_bias = o_bias = bool(d.get("attention_bias", False))
        default_head_dim = QWEN3_DEFAULT_HEAD_DIM if model_type == "qwen3" else hidden // heads
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(d.get("head_dim") or default_head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.pop("rope_theta")),
            rope=rope,
            max_position_embeddings=int(d.get("max_position_embeddings") or DEFAULT_MAX_LENGTH),
            tie_word_embeddings=d.get("tie_word_embeddings"),
            attention_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            sliding_window=window,
            sliding_layers=sliding_layers,
            qk_norm=model_type in QK_NORM_FAMILY,
        )


def _sliding_window(d: Mapping[str, Any], layers: int) -> Tuple[Optional[int], Tuple[bool, ...]]:
    """(window, per-layer use) as transformers reads them: Llama has no window; Mistral windows every layer
    (4096 when config.json is silent, none when it says null); Qwen2 and Qwen3 only with use_sliding_window,
    and then the layers its layer_types mark "sliding_attention" (by default those from max_window_layers
    on)."""
    kind = d.get("model_type")
    if kind == "llama" or (kind in ("qwen2", "qwen3") and not d.get("use_sliding_window", False)):
        return None, (False,) * layers
    window = d.get("sliding_window", MISTRAL_DEFAULT_WINDOW if kind == "mistral" else QWEN2_DEFAULT_WINDOW)
    if not window:
        return None, (False,) * layers
    if kind == "mistral":
        return int(window), (True,) * layers
    types = d.get("layer_types")
    if not (isinstance(types, list) and len(types) == layers):  # absent (or another depth: an EAGLE head)
        first = d.get("max_window_layers", QWEN2_DEFAULT_WINDOW_LAYERS)
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise SpecplayError(f"max_window_layers must be a non-negative integer (got {first!r})")
        sliding = tuple(i >= first for i in range(layers))
    else:
        sliding = tuple(t == "sliding_attention" for t in types)
    return (int(window), sliding) if any(sliding) else (None, sliding)


def _rope_params(d: Mapping[str, Any]) -> Dict[str, Any]:
    """Merge the 4.x (`rope_theta`, `rope_scaling`) and 5.x (`rope_parameters`) spellings into one dict."""
    params: Dict[str, Any] = dict(d.get("rope_scaling") or {})
    rp = d.get("rope_parameters") or {}
    if isinstance(rp, Mapping) and "full_attention" in rp:  # per-layer-type form: take full attention's
        rp = rp["full_attention"]
    params.update(rp)
    params.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.pop("type", None)) or "default"
    params.pop("type", None)
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedLlamaConfig("partial_rotary_factor != 1 is not supported by the compact forward")
    kind = params["rope_type"]
    if kind not in ("default", "linear", "llama3"):
        raise UnsupportedLlamaConfig(f"rope type {kind!r} is not supported by the compact forward")
    return params


def rope_inv_freq(spec: LlamaSpec) -> torch.Tensor:
    """Inverse rotary frequencies [head_dim/2] float32 for the default, "linear" and "llama3" rope types."""
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = spec.rope["rope_type"]
    if kind == "linear":
        return inv_freq / float(spec.rope["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, spec.rope, spec.max_position_embeddings)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, p: Mapping[str, Any], max_pos: int) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, the band between blended."""
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p.get("original_max_position_embeddings") or max_pos)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def read_config_json(path, name: Optional[str] = None) -> dict:
    """config.json of a model directory as a dict; SpecplayError naming the model (name, else the path) and
    the file when it is missing or corrupt."""
    cfg_path = Path(path) / "config.json"
    who = name or str(path)
    if not cfg_path.is_file():
        raise SpecplayError(f"{who}: no config.json (not a Hugging Face model directory)")
    try:
        data = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecplayError(f"{who}: corrupt config.json at {cfg_path} ({exc})") from None
    if not isinstance(data, dict):
        raise SpecplayError(f"{who}: corrupt config.json at {cfg_path} (not a JSON object)")
    return data


# ------------------------------------------------------------------------------------------------------------
# Weights


def _safetensors_files(root: Path) -> List[Path]:
    """model.safetensors, or the shards named by model.safetensors.index.json."""
    files = validate.safetensors_files(root)
    if not files:
        raise SpecplayError(f"{root}: no model.safetensors (or sharded index); only safetensors are read")
    return files


def load_safetensors(path: Union[str, Path], device: torch.device) -> Dict[str, torch.Tensor]:
    """All tensors of model.safetensors or of its shards, loaded straight onto `device`."""
    from safetensors import SafetensorError, safe_open

    root = Path(path)
    tensors: Dict[str, torch.Tensor] = {}
    for file in _safetensors_files(root):
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise SpecplayError(f"{file}: cannot read weights ({exc})") from None
    return tensors


@dataclass
class _Layer:
    """One decoder layer's weights, with q/k/v and gate/up fused so each costs one matmul."""

    ln1: torch.Tensor  # [H]
    w_qkv: torch.Tensor  # [(heads + 2 kv_heads) * head_dim, H]
    b_qkv: Optional[torch.Tensor]  # [(heads + 2 kv_heads) * head_dim]
    w_o: torch.Tensor  # [H, heads * head_dim]
    b_o: Optional[torch.Tensor]  # [H]
    ln2: torch.Tensor  # [H]
    w_gate_up: torch.Tensor  # [2 I, H]
    b_gate_up: Optional[torch.Tensor]  # [2 I]
    w_down: torch.Tensor  # [H, I]
    b_down: Optional[torch.Tensor]  # [H]
    q_norm: Optional[torch.Tensor] = None  # [head_dim] (Qwen3), else None
    k_norm: Optional[torch.Tensor] = None  # [head_dim] (Qwen3), else None


class _WeightSource:
    """Hands out a checkpoint's tensors in the runner's dtype; a missing one is an error naming the path.

    It takes the tensors out of the dict it is given (which ends up empty), so that each checkpoint tensor is
    freed once converted or fused: loading then peaks near one copy of the weights, not two."""

    def __init__(self, tensors: Dict[str, torch.Tensor], path: Union[str, Path], dtype: torch.dtype):
        self.tensors = validate.normalise_llama_names({k: tensors.pop(k) for k in list(tensors)})
        self.path = path
        self.dtype = dtype

    def has(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str) -> torch.Tensor:
        try:
            t = self.tensors.pop(name)
        except KeyError:
            raise SpecplayError(f"{self.path}: weight {name!r} missing from the checkpoint") from None
        return t.to(self.dtype)

    def maybe(self, name: str, present: bool) -> Optional[torch.Tensor]:
        return self.take(name) if present else None


def _cat_optional(parts: List[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    return None if any(p is None for p in parts) else torch.cat(parts)  # type: ignore[arg-type]


def _load_layer(src: _WeightSource, spec: LlamaSpec, i: int) -> _Layer:
    p = f"model.layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    bias = spec.attention_bias
    return _Layer(
        ln1=src.take(p + "input_layernorm.weight"),
        w_qkv=torch.cat([src.take(a + n + "_proj.weight") for n in "qkv"]),
        b_qkv=_cat_optional([src.maybe(a + n + "_proj.bias", bias) for n in "qkv"]),
        w_o=src.take(a + "o_proj.weight"),
        b_o=src.maybe(a + "o_proj.bias", spec.o_bias),
        ln2=src.take(p + "post_attention_layernorm.weight"),
        w_gate_up=torch.cat([src.take(m + "gate_proj.weight"), src.take(m + "up_proj.weight")]),
        b_gate_up=_cat_optional([src.maybe(m + n + "_proj.bias", spec.mlp_bias) for n in ("gate", "up")]),
        w_down=src.take(m + "down_proj.weight"),
        b_down=src.maybe(m + "down_proj.bias", spec.mlp_bias),
        q_norm=src.maybe(a + "q_norm.weight", spec.qk_norm),
        k_norm=src.maybe(a + "k_norm.weight", spec.qk_norm),
    )


def spec_from_config(path: Path, config: Mapping[str, Any]) -> LlamaSpec:
    """The spec of a Llama-family config.json, its values checked alone and against each other.
    SpecplayError naming the field and the file; UnsupportedLlamaConfig for a feature the compact forward
    lacks (the caller falls back to transformers)."""
    cfg_path = path / "config.json"
    validate.check_config_values(config, cfg_path)
    validate.require_fields(config, LLAMA_REQUIRED, cfg_path)
    try:
        spec = LlamaSpec.from_dict(config)
    except UnsupportedLlamaConfig:
        raise
    except (SpecplayError, ValueError, TypeError, KeyError) as exc:
        raise SpecplayError(f"{cfg_path}: {exc}") from None
    validate.check_llama_config(spec, config, cfg_path)
    return spec


def validated_spec(path: Path, config: Mapping[str, Any], device: torch.device, dtype: torch.dtype,
                   max_length: Optional[int]):
    """(spec, max_length) once config.json, the safetensors headers and the memory estimate agree; nothing
    large is allocated before (see spec_from_config for the errors)."""
    cfg_path = path / "config.json"
    spec = spec_from_config(path, config)
    max_length = int(max_length or min(spec.max_position_embeddings, DEFAULT_MAX_LENGTH))
    if max_length < 1:
        raise SpecplayError(f"max_length {max_length}: must be at least 1")
    header = validate.read_checkpoint_header(path)
    if not header:
        raise SpecplayError(f"{path}: no model.safetensors (or sharded index); only safetensors are read")
    used = validate.check_llama_checkpoint(spec, header, cfg_path)
    estimate = validate.llama_memory(spec, header, used, dtype, max_length)
    validate.check_memory(estimate, device, path, max_length)
    return spec, max_length


# ------------------------------------------------------------------------------------------------------------
# Math


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm, one fused kernel on GPU; it accumulates in float32 like transformers' LlamaRMSNorm, which
    also rounds once more before the weight. x: [n, H] -> [n, H] in x's dtype."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding: x * cos + rotate_half(x) * sin, with rotate_half(x) * sin written as the halves of x
    swapped times [-sin, sin] (3 kernels instead of 5). x: [n, heads, D]; cos, sin_signed: [n, 1, D]."""
    half = x.shape[-1] // 2
    swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)  # [x2, x1]
    return torch.addcmul(x * cos, swapped, sin_signed)


def rope_tables(inv_freq: torch.Tensor, max_length: int, dtype: torch.dtype) -> tuple:
    """cos and [-sin, sin] [max_length, D] each for every cache position (apply_rope's tables), computed in
    float32 like transformers and rounded to dtype; on inv_freq's device."""
    positions = torch.arange(max_length, device=inv_freq.device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [max_length, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_length, D]
    half = freqs.shape[-1]
    sin = emb.sin()
    sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return emb.cos().to(dtype), sin_signed.to(dtype)


def block_columns(cols: torch.Tensor, start: torch.Tensor, block_visible: torch.Tensor) -> tuple:
    """Which cache columns cols [kv] a block of n rows at cache row start ([1] on the device) sees: every row
    before start, and block row j where block_visible[i, j] ([n, n] bool); the rows past the block none (kv
    may reach beyond it). Returns (visible [n, kv] bool, in_block [kv], each column's row in the block
    [kv])."""
    n = block_visible.shape[0]
    offset = cols - start  # [kv]: a column's row inside the block
    in_block = (offset >= 0) & (offset < n)
    block_col = offset.clamp(0, n - 1)  # [kv]
    visible = block_visible[:, block_col] & in_block  # [n, kv]
    visible |= (cols < start)[None, :]
    return visible, in_block, block_col


def norm_heads(qkv: torch.Tensor, layer: "_Layer", spec: "LlamaSpec") -> torch.Tensor:
    """Qwen3's per-head RMSNorms: each of q's heads normalised over head_dim with layer.q_norm [D], each of
    k's with layer.k_norm [D], v kept; qkv itself when the layer has none. qkv [n, (heads + 2 kvh) D] ->
    a new contiguous [n, (heads + 2 kvh) D]. Fixed shapes and no host value: CUDA graphs capture it."""
    if layer.q_norm is None:
        return qkv
    d = spec.head_dim
    q_dim, kv_dim = spec.num_heads * d, spec.num_kv_heads * d
    q = rms_norm(qkv[:, :q_dim].unflatten(-1, (spec.num_heads, d)), layer.q_norm, spec.rms_norm_eps)
    k = rms_norm(qkv[:, q_dim:q_dim + kv_dim].unflatten(-1, (spec.num_kv_heads, d)), layer.k_norm,
                 spec.rms_norm_eps)  # [n, kvh, D]
    return torch.cat((q.flatten(1), k.flatten(1), qkv[:, q_dim + kv_dim:]), dim=-1)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [n, H] followed by copies of its last row, to [rows, H] (x itself when rows == n)."""
    n = x.shape[0]
    return x if rows == n else torch.cat([x, x[-1:].expand(rows - n, -1)])


def _linear_residual(x: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor,
                     bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x + inputs @ weight.T (+ bias); without a bias the residual add rides in the GEMM (one kernel)."""
    if bias is None:
        return torch.addmm(x, inputs, weight.t())
    return x + F.linear(inputs, weight, bias)


def _add_linear_(x: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x += inputs @ weight.T (+ bias), in place: the GEMM adds into x itself, where torch.addmm would first
    copy x into a new output (a device copy per residual add). The same sums as _linear_residual."""
    if bias is None:
        return x.addmm_(inputs, weight.t())
    return x.add_(F.linear(inputs, weight, bias))


# ------------------------------------------------------------------------------------------------------------
# Runner


class LlamaRunner(CausalRunner):
    """Llama / Qwen2 / Qwen3 / Mistral forward over a static KV cache; chains and trees."""

    supports_tree = True
    forward_path = "fast path"

    def __init__(
        self,
        spec: LlamaSpec,
        tensors: Dict[str, torch.Tensor],
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_length: int,
        path: Union[str, Path] = "<weights>",
    ):
        self.spec = spec
        self.device = torch.device(device)
        self.dtype = dtype
        self.vocab_size = spec.vocab_size
        self.hidden_size = spec.hidden_size
        self.max_length = int(max_length)
        # A window at least as long as the cache never hides a row: such a model runs the full-attention path.
        w = spec.sliding_window
        self._window = w if w is not None and w < self.max_length and any(spec.sliding_layers) else None
        src = _WeightSource(tensors, path, dtype)
        self.embed_weight = src.take("model.embed_tokens.weight")  # [V, H]
        self.layers = [_load_layer(src, spec, i) for i in range(spec.num_layers)]
        self.norm_weight = src.take("model.norm.weight")  # [H]
        self.lm_head = self._lm_head(src)  # [V, H]
        self.inv_freq = rope_inv_freq(spec).to(self.device)  # [D/2] float32
        # [max_length, D] each, looked up by position
        self._cos, self._sin_signed = self._rope_tables()
        shape = (spec.num_layers, 2, spec.num_kv_heads, self.max_length, spec.head_dim)
        self.kv = torch.zeros(shape, device=self.device, dtype=dtype)  # [L, 2, kv_heads, max_length, D]
        # [max_length], sliced for positions
        self._arange = torch.arange(self.max_length, device=self.device)
        self._length = 0
        self._start = torch.zeros(1, dtype=torch.long, device=self.device)  # the block's first row, on device
        self._chains: Dict[int, tuple] = {}  # n -> (depth [n], block_visible [n, n]) of a chain block
        self._trees: Dict[tuple, tuple] = {}  # parents -> the same for a tree block
        self.use_graphs = self.device.type == "cuda"  # see CapturedStep; switch off to compare with eager
        self.pad_blocks = self.device.type == "cuda"  # chain blocks run padded to a bucket (block_bucket)
        # CUDA: fused rope/cache and SiLU kernels, else None
        self.fused_kernels = StepKernels.load(self.device)
        self.decode_kernels = self._decode_kernels()  # the fused decode path for short blocks, else None
        self._gemv_ok: Dict[int, bool] = {}  # block rows -> whether sp_gemv does its products
        self._graphs: Dict[tuple, "CapturedStep"] = {}  # (n, kv, tap_layers) -> captured step
        self.pool_handle = None
        # Layers whose outputs a forward also returns (ForwardOutput.taps, side by side in this order); set by
        # the decoder for a drafter that asks for them (EAGLE-3). Empty: nothing is collected.
        self.tap_layers: Tuple[int, ...] = ()
        self._tapped: List[torch.Tensor] = []  # step_embeds' collection for the current step
        self.last_taps: Optional[torch.Tensor] = None  # [n, len(tap_layers) * H] of the last block step

    # -- construction --------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: Union[str, Path], device: Union[str, torch.device] = "cpu",
                        dtype: torch.dtype = torch.float32,
                        max_length: Optional[int] = None) -> "LlamaRunner":
        """Load a local Hugging Face directory (config.json + safetensors), validated before anything large is
        allocated (`validated_spec`). max_length (the KV cache size) defaults to
        min(max_position_embeddings, 4096)."""
        device = torch.device(device)
        spec, max_length = validated_spec(Path(path), read_config_json(path), device, dtype, max_length)
        tensors = load_safetensors(path, device)
        return cls(spec, tensors, device=device, dtype=dtype, max_length=max_length, path=path)

    def _lm_head(self, src: _WeightSource) -> torch.Tensor:
        if src.has("lm_head.weight") and self.spec.tie_word_embeddings is not True:
            return src.take("lm_head.weight")
        if self.spec.tie_word_embeddings is False:
            src.take("lm_head.weight")  # raises: an untied model without an lm_head
        return self.embed_weight  # tied (or config silent and no lm_head stored)

    # -- CausalRunner ----------------------------------------------------------------------------------------

    @property
    def length(self) -> int:
        return self._length

    def row_indices(self, n: int) -> torch.Tensor:
        """arange(n) on the device, sliced from one made at load (no allocation in a capture)."""
        return self._arange[:n]

    def rope_tables(self) -> tuple:
        """(cos, sin with its first half negated) [max_length, D] each, looked up by position."""
        return self._cos, self._sin_signed

    def use_torch_twins(self) -> None:
        """Run without the step kernels (engine.tuning: SPECPLAY_TORCH_TWINS=1): cuBLAS, SDPA and torch's
        operations on every path."""
        self.fused_kernels = self.decode_kernels = None

    def reset(self) -> None:
        self._length = 0  # stale rows are never visible: the mask hides every row >= length

    def set_length(self, length: int) -> None:
        """The host's view of the cache after a captured chain or round wrote its rows on the device (no
        check: those rows may lie past what the host saw, up to max_length)."""
        self._length = int(length)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"rollback to {length}: cache holds {self._length} tokens")
        self._length = int(length)

    def compact(self, start: int, keep: torch.Tensor) -> None:
        m = keep.numel()
        if start < 0 or start + m > self._length:
            raise ValueError(f"compact(start={start}, {m} rows) outside the cache of {self._length} tokens")
        rows = keep.to(self.device, torch.long) + start  # [m]
        # The gather copies first, so overlapping source/destination rows are safe.
        self.kv[:, :, :, start : start + m] = self.kv.index_select(3, rows)
        self._length = start + m

    def warm_up_buckets(self) -> None:
        """One prefill of each bucket up to PREFILL_GRAPH_ROWS (the captured ones), so that a first prompt
        finds its graph captured and cuBLAS's algorithm chosen; the first prefill past the decode path also
        loads SDPA's and cuBLAS's kernels for longer blocks (~80 ms at the 1B shape on an H200, once). The
        cache is left reset. Does nothing when blocks are not padded."""
        if not self.pad_blocks:
            return
        for rows in prefill_buckets():
            if rows > self.max_length:
                break
            self.reset()
            self.forward(torch.zeros(rows, dtype=torch.long, device=self.device))  # [rows] token 0
        self.reset()

    def warm_up_steps(self, max_rows: int) -> None:
        """The captured decode steps of 1..max_rows rows, captured before the first prompt: a round's block
        is the last token and its draft, so n-gram's first rounds (a draft of 0..K tokens) and the trees
        meet sizes the warm-up generation of a method may not have, and each new size would be captured
        inside a measured round. The cache is left reset. Does nothing without graphs or decode kernels."""
        if not (self.use_graphs and self.decode_path(1)):
            return
        self.reset()
        self.forward(torch.zeros(1, dtype=torch.long, device=self.device))  # a committed row: start 1
        for rows in range(1, min(max_rows, DECODE_ROWS, GRAPH_MAX_BLOCK, self.max_length - 1) + 1):
            self._captured_step(rows, self._length)
        self.reset()

    # a drafter may hand forward a tree block built on the device (Draft.tree_block)
    takes_device_trees = True

    def forward(self, tokens: torch.Tensor, parents: Optional[torch.Tensor] = None,
                tree: Optional[tuple] = None) -> ForwardOutput:
        """See CausalRunner.forward. tree: instead of parents, a tree block's (depth [n], visible [n, n] bool)
        already on the device (ancestor-or-self), so that a tree drafted there needs no host copy."""
        tokens = fill_unknown(tokens.to(self.device).reshape(-1), self.vocab_size, self.input_fill)
        return self._forward(F.embedding(tokens, self.embed_weight), parents, tree)

    # a round graph's replay may write a block at a start known on the device only (occupy)
    takes_device_starts = True

    def occupy(self, latest: int, n: int) -> None:
        """A block of n rows went in at a device start of at most latest (a round graph's replay,
        engine.core.graphs): the length becomes latest + n, an upper bound until the decoder rolls back
        to
        the real end. Rows between the real end and latest + n are never visible: the attention's mask ends
        at the block the device start placed."""
        if latest > self._length:
            raise ValueError(f"a block at row {latest} is past the cache's {self._length} tokens")
        if latest + n > self.max_length:
            raise SpecplayError(f"context full: {latest} cached + {n} new tokens exceed max_length "
                                f"{self.max_length}")
        self._length = latest + n

    def forward_embeds(self, inputs: torch.Tensor, parents: Optional[torch.Tensor] = None) -> ForwardOutput:
        """Like forward, from input vectors [n, H] instead of token ids (the EAGLE head feeds fused
        features)."""
        return self._forward(inputs.to(self.device, self.dtype), parents)

    def _forward(self, x: torch.Tensor, parents: Optional[torch.Tensor], tree: Optional[tuple] = None
                 ) -> ForwardOutput:
        """x [n, H] at the cache's end. A padded chain block runs as `rows` rows; the padding rows come after
        the real ones, so causal attention keeps them out of the real rows' outputs, and their K/V land past
        the new length, hidden from every later step (and overwritten by the next block)."""
        n = x.shape[0]
        start = self._length
        if start + n > self.max_length:
            raise SpecplayError(
                f"context full: {start} cached + {n} new tokens exceed max_length {self.max_length}"
            )
        if tree is None and parents is not None:
            tree = self.tree_block(parents.reshape(n))
        rows = self._block_rows(n, start, tree is not None)
        bucketed = tree is None and self.pad_blocks and is_bucket(rows)
        hidden, logits = self._run_block(_pad_rows(x, rows), start, tree, bucketed)
        self._length = start + n
        if rows > n:  # only the real rows' outputs leave
            hidden, logits = hidden[:n], logits[:n]  # [n, H], [n, V]
            self.last_taps = None if self.last_taps is None else self.last_taps[:n]  # [n, taps * H]
        return ForwardOutput(logits, hidden, self.last_taps if self.tap_layers else None)

    def _block_rows(self, n: int, start: int, is_tree: bool) -> int:
        """The rows a block of n runs as: its bucket for a chain block when padding is on and the bucket fits
        in the cache, else n (trees are never padded: their mask and positions come from parents)."""
        if is_tree or not self.pad_blocks:
            return n
        bucket = block_bucket(n)
        return bucket if start + bucket <= self.max_length else n

    def _run_block(self, x: torch.Tensor, start: int, tree: Optional[tuple], bucketed: bool):
        """x [rows, H] at cache rows start.. -> (features [rows, H], logits [rows, V]), captured or eager.
        tree: a tree block's (depth, visible) on the device, None for a chain; bucketed: a padded chain block
        whose rows are a bucket (see _captured_step)."""
        rows = x.shape[0]
        depth, block_visible = self.chain_block(rows) if tree is None else tree
        captured = self._captured_step(rows, start, bucketed)
        if captured is not None:
            return captured.run(x, start, depth, block_visible, tree is None)
        self._start.fill_(start)
        return self.block_step(x, self._start, depth, block_visible, self.kv_width(start + rows))

    def block_step(self, x, start, depth, block_visible, kv: int, after_step_kernel: bool = False):
        """x [n, H] at cache rows start..start+n-1 (start: [1] device) -> (features [n, H], logits [n, V]).
        Only device tensors go in, so the CUDA graph captures exactly this (the tap layers' outputs too, left
        in last_taps). after_step_kernel: the caller's last kernel (which made x) is a step kernel, so the
        first product may start early behind it (engine.kernels.step._launch_grid's chained)."""
        if self.decode_path(x.shape[0]):
            return self._decode_block(x, start, depth, block_visible, after_step_kernel)
        positions, cache_index, mask, window_mask = self._block_inputs(start, depth, block_visible, kv)
        hidden = self._tapped_step(x, positions, cache_index, mask, window_mask)
        return hidden, self.logits_from_hidden(hidden)

    def _tapped_step(self, x, positions, cache_index, mask, window_mask):
        """step_embeds, keeping the tap layers' outputs side by side in last_taps [n, taps * H] (None when no
        layer is tapped)."""
        self._tapped = []
        hidden = self.step_embeds(x, positions, cache_index, mask, window_mask)
        self.last_taps = torch.cat(self._tapped, dim=-1) if self.tap_layers else None
        self._tapped = []
        return hidden

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.project(self.final_norm(hidden))  # [n, V]

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm on features [n, H] (what the LM head and Medusa heads read)."""
        return rms_norm(hidden.to(self.dtype), self.norm_weight, self.spec.rms_norm_eps)  # [n, H]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head alone: normed features [n, H] -> logits [n, V] float32."""
        return F.linear(x.to(self.dtype), self.lm_head).float()  # [n, V]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens.to(self.device), self.embed_weight)  # [n, H]

    # -- masks -----------------------------------------------------------------------------------------------

    def chain_block(self, n: int):
        """A chain of n: depths 0..n-1, and token i sees block tokens 0..i. Built once per n."""
        if n not in self._chains:
            self._chains[n] = (self._arange[:n].clone(),
                               torch.ones(n, n, dtype=torch.bool, device=self.device).tril())
        return self._chains[n]

    def tree_block(self, parents: torch.Tensor):
        """(depth [n], block_visible [n, n] bool) on the device for a tree block. Tree shapes repeat from
        round to round (Medusa's never changes), so each is built and copied once. parents: [n], best on the
        host."""
        key = tuple(parents.tolist())
        block = self._trees.get(key)
        if block is None:
            parents = parents.cpu()
            block = (to_device(tree_depths(parents), self.device),
                     to_device(tree_ancestor_mask(parents), self.device, torch.bool))
            if len(self._trees) >= TREE_SHAPES_KEPT:
                self._trees.clear()
            self._trees[key] = block
        return block

    def _block_inputs(self, start: torch.Tensor, depth: torch.Tensor, block_visible: torch.Tensor, kv: int):
        """positions [n] = start + depth, cache rows [n] = start + i, additive mask [n, kv]: every cached row
        before start, plus the block rows block_visible allows; rows past the block stay hidden, so kv may be
        padded beyond start + n. The fourth value is the sliding-window mask [n, kv] (None without a window).
        start: [1] device int64; depth: [n]; block_visible: [n, n] bool."""
        n = depth.numel()
        cache_index = start + self._arange[:n]  # [n]
        cols = self._arange[:kv]  # [kv]
        visible, in_block, block_col = block_columns(cols, start, block_visible)
        positions = start + depth  # [n]
        if self._window is None:
            return positions, cache_index, self._additive(visible), None
        # Cached row r holds position r; block column j holds position start + depth[j].
        key_positions = torch.where(in_block, start + depth[block_col], cols)  # [kv]
        near = (positions[:, None] - key_positions[None, :]) < self._window  # [n, kv]
        return positions, cache_index, self._additive(visible), self._additive(visible & near)

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        """bool -> additive float mask: 0 where visible, -inf elsewhere (every SDPA backend honours it)."""
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~visible, float("-inf"))

    # -- CUDA graphs -----------------------------------------------------------------------------------------

    def kv_width(self, rows: int) -> int:
        """Cache rows a step attends over. On GPU, rounded up to a bucket: a captured graph then serves many
        lengths, and SDPA's memory-efficient kernel wants an aligned mask (unaligned, it pads on every
        call)."""
        if self.device.type != "cuda":
            return rows
        return min(self.max_length, -(-rows // KV_BUCKET) * KV_BUCKET)

    def _captured_step(self, n: int, start: int, bucketed: bool = False) -> Optional["CapturedStep"]:
        """The captured step for n tokens at this length, capturing it on first use; None runs eagerly. On the
        decode path the attention reads the block's start on the device: one graph per n serves every
        length. A block at the cache's start is a prefill: captured only when bucketed (padded to a bucket,
        so a few graphs serve every prompt length), up to PREFILL_GRAPH_ROWS rows; an unpadded one would
        capture a graph per prompt length, which stalls. (Off the decode path the key holds the kv width,
        which at start 0 the bucket fixes.) At start 0 the capture's warm-up writes rows 0..n-1, which are
        free (the cache is empty)."""
        if not self.use_graphs:
            return None
        if start == 0:
            if not bucketed or n > PREFILL_GRAPH_ROWS:
                return None
        elif n > GRAPH_MAX_BLOCK:
            return None
        decode = self.decode_path(n)
        key = (n, 0 if decode else self.kv_width(start + n), self.tap_layers)
        if key not in self._graphs:
            if len(self._graphs) >= GRAPH_LIMIT:
                return None
            graph = captured(self, lambda: CapturedStep(self, n, key[1], self.graph_pool()), "step")
            if graph is None:
                return None
            self._graphs[key] = graph
        return self._graphs[key]

    def graph_pool(self):
        """The memory pool this runner's graphs record into (a new one after a failed capture)."""
        if self.pool_handle is None:
            self.pool_handle = torch.cuda.graph_pool_handle()
        return self.pool_handle

    # -- the decode path (CUDA, bf16/fp16) -----------------------------------------------------------------

    def _decode_kernels(self) -> Optional[StepKernels]:
        """The step kernels when short blocks may take the decode path: bf16/fp16 on CUDA, shapes the kernels
        read (rows a multiple of 8, head dim <= 256, 16-byte aligned weights), no sliding window."""
        kernels, s = self.fused_kernels, self.spec
        if kernels is None:
            return None
        if self.dtype not in HALF_DTYPES or self._window is not None:
            return None
        if s.head_dim % 8 or s.head_dim > ATTENTION_MAX_D or s.hidden_size % 8 or s.intermediate_size % 8:
            return None
        return kernels

    def _gemv_rows(self, n: int) -> bool:
        """Whether a block of n rows runs every product (the LM head's too) in sp_gemv; decided once per n."""
        if n not in self._gemv_ok:
            weights = [self.lm_head] + [w for layer in self.layers
                                        for w in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down)]
            self._gemv_ok[n] = n <= DECODE_GEMV_ROWS and all(gemv_fits(w, n) for w in weights)
        return self._gemv_ok[n]

    def step_ends_in_kernel(self, n: int) -> bool:
        """Whether a block step of n rows ends in a step kernel (the LM head in sp_gemv): the round's next
        kernel may then be a programmatic launch behind it."""
        return self.decode_path(n) and self._gemv_rows(n)

    def decode_path(self, n: int) -> bool:
        return self.decode_kernels is not None and n <= DECODE_ROWS

    def _decode_block(self, x, start, depth, block_visible, after_step_kernel: bool = False):
        """The step on the decode kernels: x [n, H] (n <= 64) at cache rows start.. (start [1] on the
        device) -> (features [n, H], logits [n, V] float32). Blocks of up to DECODE_GEMV_ROWS rows run every
        product in sp_gemv; longer ones keep cuBLAS for the products."""
        n = x.shape[0]
        # the rope kernel reads start itself: positions start + depth, rows start + i
        positions, cache_index = depth.long().contiguous(), None
        self._tapped = []
        hidden = self._decode_layers(x, positions, cache_index, start, block_visible.contiguous(),
                                     chained=after_step_kernel)
        self.last_taps = torch.cat(self._tapped, dim=-1) if self.tap_layers else None
        self._tapped = []
        if not self._gemv_rows(n):
            return hidden, self.project(self.block_norm(hidden, self.norm_weight))
        logits = self.decode_kernels.gemv(hidden, self.lm_head, norm_weight=self.norm_weight,
                                          eps=self.spec.rms_norm_eps, out_f32=True,
                                          chained=not self.tap_layers)  # [n, V] (the taps' cat comes first)
        return hidden, logits

    def _decode_layers(self, x, positions, cache_index, start, block_visible,
                       earlier: int = 0, chained: bool = False) -> torch.Tensor:
        """The decoder stack on the decode kernels: x [n, H] -> features [n, H]. Per layer: qkv (RMSNorm
        fused in), rope + cache write, attention, o (+ residual), gate|up (RMSNorm fused in, SiLU * up in its
        epilogue where sp_gemv takes it), down (the residual fused in); past DECODE_GEMV_ROWS rows the
        products are cuBLAS's (each adding the residual into x in place) and the norms sp_rms_norm. earlier:
        rows of the attention's block before x's, already in the cache (a tree level's earlier nodes, see
        step_tree_level): block_visible is [earlier + n, earlier + n], their queries are zeros and their
        outputs dropped. cache_index None: positions are depths after start and the rows start + i (the rope
        kernel adds start). chained: the stream's last kernel is a step kernel (the first product may start
        early behind it)."""
        s, k = self.spec, self.decode_kernels
        eps = s.rms_norm_eps
        small = self._gemv_rows(x.shape[0])
        if not small:
            x = x.clone(memory_format=torch.contiguous_format)  # the residual adds below write into x
        # chained=True where the previous kernel is one of the step kernels (see step.py's _launch_grid)
        for li, layer in enumerate(self.layers):
            keys, values = self.kv[li, 0], self.kv[li, 1]  # [kvh, max_length, D] each
            if small:
                qkv = k.gemv(x, layer.w_qkv, layer.b_qkv, norm_weight=layer.ln1, eps=eps,
                              chained=li > 0 or chained)
            else:
                qkv = F.linear(self.block_norm(x, layer.ln1), layer.w_qkv, layer.b_qkv)
            qkv = norm_heads(qkv, layer, s)  # Qwen3: torch's norms come between the qkv product and rope
            q = k.rope_qkv(qkv, self._cos, self._sin_signed, positions, cache_index, keys, values,
                           s.num_heads, s.num_kv_heads, chained=small and layer.q_norm is None,
                           start=start if cache_index is None else None)  # [heads, n, D]
            if earlier:
                q = torch.cat((q.new_zeros(q.shape[0], earlier, q.shape[2]), q), 1)  # [heads, earlier + n, D]
            attn = k.attention(q, keys, values, start, block_visible, chained=not earlier)  # [., heads * D]
            attn = attn[earlier:]  # [n, heads * D]
            if small:
                x = k.after_attention(attn, x, layer.w_o, layer.w_gate_up, layer.ln2, eps, layer.w_down,
                                      layer.b_o, layer.b_gate_up, layer.b_down)
            else:
                x = _add_linear_(x, attn, layer.w_o, layer.b_o)
                gate_up = F.linear(self.block_norm(x, layer.ln2), layer.w_gate_up, layer.b_gate_up)
                x = _add_linear_(x, k.silu_mul(gate_up), layer.w_down, layer.b_down)
            if li in self.tap_layers:  # EAGLE-3 reads these layers' outputs (see _tapped_step)
                self._tapped.append(x if small else x.clone())  # (the cuBLAS branch adds into x in place)
        return x

    def block_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of rows x [n, H] where cuBLAS multiplies on the decode path (long blocks, batches):
        sp_rms_norm."""
        return self.decode_kernels.rms_norm(x, weight, self.spec.rms_norm_eps)

    def takes_tree_levels(self, rows: int, nodes: int) -> bool:
        """Whether step_tree_level runs a level of `rows` nodes after earlier ones, `nodes` in all."""
        return self.decode_path(rows) and nodes <= DECODE_ROWS and not self.tap_layers

    def step_tree_level(self, x: torch.Tensor, positions: torch.Tensor, start: torch.Tensor, earlier: int,
                        visible: torch.Tensor) -> torch.Tensor:
        """One level of a draft tree grown in this runner's cache, on the decode kernels: x [n, H] (positions
        [n]) are the level's nodes, written at cache rows start + earlier.. after the `earlier` nodes of the
        levels before (start [1] on the device). Each node sees the cache rows before start and its ancestors
        among the nodes (visible [earlier + n, earlier + n], ancestor-or-self). Returns features [n, H]
        (pre-norm), as step_embeds with the mask of those rows does, in a few kernels per layer and without
        attending over the whole cache."""
        cache_index = start + earlier + self._arange[:x.shape[0]]  # [n]
        self._tapped = []
        return self._decode_layers(x, positions, cache_index, start, visible.contiguous(), earlier)

    # -- the step --------------------------------------------------------------------------------------------

    def step_embeds(
        self, x: torch.Tensor, positions: torch.Tensor, cache_index: torch.Tensor, mask: torch.Tensor,
        window_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Run the decoder on input vectors x [n, H], write their K/V at `cache_index`, return features [n, H]
        (pre-norm).

        positions, cache_index: [n] device int64. mask: [n, kv] additive float; attention reads cache
        rows 0..kv-1, so kv >= max(cache_index) + 1. window_mask: like mask, for the sliding-window layers
        (None: every layer uses mask). Nothing here depends on host values, so for a fixed n and kv this step
        is captured in a CUDA graph (CapturedStep)."""
        s = self.spec
        n = x.shape[0]
        group = s.num_heads // s.num_kv_heads
        q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        fused = self.fused_kernels
        if fused is None:
            # [n, 1, D] each
            cos, sin = self._cos[positions][:, None], self._sin_signed[positions][:, None]
        # [1, 1, group * n, kv]: row g*n + i is query i of group member g. Four dimensions, so that SDPA may
        # pick its memory-efficient kernel rather than the many-kernel math path.
        mask_g = mask.repeat(group, 1)[None, None]
        layer_masks = [mask_g] * len(self.layers)
        if window_mask is not None:
            window_g = window_mask.repeat(group, 1)[None, None]
            layer_masks = [window_g if w else mask_g for w in s.sliding_layers]
        kv = mask.shape[-1]
        for li, layer in enumerate(self.layers):
            h = rms_norm(x, layer.ln1, s.rms_norm_eps)
            qkv = F.linear(h, layer.w_qkv, layer.b_qkv)  # [n, (heads + 2 kv_heads) * D]
            qkv = norm_heads(qkv, layer, s)  # Qwen3's per-head norms of q and k, before rope
            if fused is not None:  # rope, both cache writes and q's layout in one kernel
                q = fused.rope_qkv(qkv, self._cos, self._sin_signed, positions, cache_index,
                                   self.kv[li, 0],
                                   self.kv[li, 1], s.num_heads, s.num_kv_heads)  # [heads, n, D]
            else:
                # rope on q and k together: they are the first heads + kv_heads head-sized slices of each row
                qk = qkv[:, :q_dim + kv_dim].unflatten(-1, (-1, s.head_dim))  # [n, h+kvh, D]
                qk = apply_rope(qk, cos, sin)
                q = qk[:, :s.num_heads].transpose(0, 1)  # [heads, n, D]
                k = qk[:, s.num_heads:].transpose(0, 1)  # [kvh, n, D]
                v = qkv[:, q_dim + kv_dim:].view(n, s.num_kv_heads, s.head_dim).transpose(0, 1)  # [kvh, n, D]
                self.kv[li, 0].index_copy_(1, cache_index, k)
                self.kv[li, 1].index_copy_(1, cache_index, v)
            keys, values = self.kv[li, 0, :, :kv], self.kv[li, 1, :, :kv]  # [kvh, kv, D]
            # GQA without copying K/V: query head h uses kv head h // group, so fold the group into the rows.
            qg = q.reshape(1, s.num_kv_heads, group * n, s.head_dim)  # [1, kvh, group * n, D]
            attn = F.scaled_dot_product_attention(qg, keys[None], values[None], attn_mask=layer_masks[li])
            attn = attn.reshape(s.num_heads, n, s.head_dim).transpose(0, 1).reshape(n, q_dim)  # [n, heads*D]
            x = self._residual_out(x, attn, layer.w_o, layer.b_o)
            h = rms_norm(x, layer.ln2, s.rms_norm_eps)
            gate_up = F.linear(h, layer.w_gate_up, layer.b_gate_up)  # [n, 2 I]
            if fused is not None:
                act = fused.silu_mul(gate_up)  # [n, I]
            else:
                gate, up = gate_up.chunk(2, dim=-1)  # [n, I] each
                act = F.silu(gate) * up
            x = self._residual_out(x, act, layer.w_down, layer.b_down)
            if li in self.tap_layers:  # EAGLE-3 reads these layers' outputs (see _tapped_step)
                self._tapped.append(x)
        return x

    def _residual_out(self, x: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor,
                      bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x + inputs @ weight.T (+ bias) for o and down: a hook, so that a tensor-parallel shard
        (engine/models/tp.py) all-reduces its partial sums here."""
        return _linear_residual(x, inputs, weight, bias)

    def _rope_tables(self):
        return rope_tables(self.inv_freq, self.max_length, self.dtype)


class CapturedStep:
    """One decoder step for a fixed block size n and attention width kv, captured as a CUDA graph.

    Eager decoding of a small model is bound by kernel launches (hundreds per step); a replay launches them
    all at once. The graph reads static input buffers, so a run copies x, start, depth and block_visible in,
    replays, and clones the outputs (callers keep them across later steps). Attention spans kv cache rows;
    the mask hides rows past the block, so one graph serves every length up to kv - n."""

    def __init__(self, runner: LlamaRunner, n: int, kv: int, pool):
        device = runner.device
        self.x = torch.zeros(n, runner.hidden_size, dtype=runner.dtype, device=device)  # [n, H]
        # Warm-up writes K/V at rows length..length+n-1: free rows, which the real step overwrites next.
        self.start = torch.full((1,), runner.length, dtype=torch.long, device=device)
        depth, block_visible = runner.chain_block(n)
        self.depth, self.block_visible = depth.clone(), block_visible.clone()  # [n], [n, n]
        self.holds_chain = True  # the buffers hold a chain's depth and mask (no copy needed for chains)

        def body():
            return runner.block_step(self.x, self.start, self.depth, self.block_visible, kv)

        with warm_up_stream(device):
            body()  # warm-up: cuBLAS handles and workspaces are created outside the capture
        self.graph = torch.cuda.CUDAGraph()
        with graph_capture(self.graph, pool, device):
            self.hidden, self.logits = body()  # [n, H], [n, V]
            self.taps = runner.last_taps  # [n, taps * H] or None
        self.runner = runner

    def run(self, x: torch.Tensor, start: int, depth: torch.Tensor, block_visible: torch.Tensor,
            is_chain: bool):
        self.x.copy_(x)
        self.start.fill_(start)
        if not (is_chain and self.holds_chain):
            self.depth.copy_(depth)
            self.block_visible.copy_(block_visible)
            self.holds_chain = is_chain
        self.graph.replay()
        self.runner.last_taps = None if self.taps is None else self.taps.clone()
        return self.hidden.clone(), self.logits.clone()
