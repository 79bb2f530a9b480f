"""Checks on a model folder before anything large is allocated.

config.json values are checked on their own (types, positive sizes, sane upper bounds), against each other
and against the checkpoint: safetensors headers are read (the 8-byte length and the JSON after it), never the
tensors. A memory estimate (weights, the KV cache for the context we allocate, rotary tables) is checked
against the memory free on the device. Every failure is a SpecplayError naming the field and the file.

Why: one edited line in config.json (hidden_size 10^7) used to build rotary tables and caches for tens of
seconds and gigabytes before anything failed, and a config the weights contradict ran silently or failed in
the middle of generation with "mat1 and mat2 shapes cannot be multiplied".
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple

import torch

from engine.errors import SpecplayError

MAX_HEADER_BYTES = 32 << 20  # real headers are KBs to a few MBs; parsing a larger one costs much RSS
GIB = float(1 << 30)

# config.json size fields (Llama names and the GPT-2 / other spellings) -> largest accepted value. Generous:
# the largest public models stay far below; anything beyond is an edit or a corruption, not a model.
SIZE_LIMITS = {
    "vocab_size": 1 << 24,
    "hidden_size": 1 << 17, "n_embd": 1 << 17, "d_model": 1 << 17,
    "intermediate_size": 1 << 20, "n_inner": 1 << 20, "ffn_dim": 1 << 20,
    "num_hidden_layers": 1 << 12, "n_layer": 1 << 12, "num_layers": 1 << 12,
    "num_attention_heads": 1 << 12, "n_head": 1 << 12, "num_key_value_heads": 1 << 12,
    "head_dim": 1 << 12,
    "max_position_embeddings": 1 << 28, "n_positions": 1 << 28, "n_ctx": 1 << 28,
    "sliding_window": 1 << 28,
}
EPS_FIELDS = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps")

# safetensors dtype -> bytes per element (None: packed or unknown, the byte count is not checked)
ST_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
    "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


# ------------------------------------------------------------------------------------------------------------
# config.json values


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_config_values(config: Mapping[str, Any], cfg_path: Path) -> None:
    """Sizes are positive integers within SIZE_LIMITS, epsilons and rope numbers finite and positive.
    Absent or null fields are left to the model's own defaults."""
    for field, limit in SIZE_LIMITS.items():
        value = config.get(field)
        if value is None:
            continue
        if not _is_int(value):
            raise SpecplayError(f"{cfg_path}: {field} must be a positive integer (got {value!r})")
        if not 1 <= value <= limit:
            raise SpecplayError(f"{cfg_path}: {field} {value} is out of range (1..{limit})")
    for field in EPS_FIELDS:
        value = config.get(field)
        if value is not None and not (_is_number(value) and 0 < value < 1):
            raise SpecplayError(f"{cfg_path}: {field} must be a number in (0, 1) (got {value!r})")
    for field in ("rope_scaling", "rope_parameters"):
        value = config.get(field)
        if value is not None and not isinstance(value, Mapping):
            raise SpecplayError(f"{cfg_path}: {field} must be an object (got {value!r})")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def require_fields(config: Mapping[str, Any], fields: Iterable[str], cfg_path: Path) -> None:
    missing = [f for f in fields if config.get(f) is None]
    if missing:
        raise SpecplayError(f"{cfg_path}: {', '.join(missing)} missing (a {config.get('model_type')} model "
                            "needs it)")


def check_rope(rope: Mapping[str, Any], cfg_path: Path) -> None:
    """rope_theta and the scaling parameters of the rope types the compact forward implements."""
    theta = rope.get("rope_theta")
    if not (_is_number(theta) and theta > 0):
        raise SpecplayError(f"{cfg_path}: rope_theta must be a positive number (got {theta!r})")
    kind = rope.get("rope_type")
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
    needed = needed.get(kind, ())
    for key in needed:
        value = rope.get(key)
        if not (_is_number(value) and value > 0):
            raise SpecplayError(f"{cfg_path}: rope type {kind!r} needs a positive {key} (got {value!r})")
    if kind == "llama3" and not rope["high_freq_factor"] > rope["low_freq_factor"]:
        raise SpecplayError(f"{cfg_path}: rope high_freq_factor must exceed low_freq_factor")
    old = rope.get("original_max_position_embeddings")
    if old is not None and not (_is_int(old) and old > 0):
        raise SpecplayError(f"{cfg_path}: original_max_position_embeddings must be a positive integer")


# ------------------------------------------------------------------------------------------------------------
# safetensors headers


class TensorInfo(NamedTuple):
    shape: Tuple[int, ...]
    dtype: str  # safetensors spelling: F32, BF16, ...
    file: Path

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * (ST_ITEMSIZE.get(self.dtype) or 1)


def read_safetensors_header(file: Path) -> Dict[str, TensorInfo]:
    """name -> TensorInfo from the header of one safetensors file; no tensor is read. The header's offsets are
    checked against the shapes and the file size (a truncated download fails here)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
                raise SpecplayError(f"{file}: not a safetensors file (header length {length}, "
                                    f"file {size} bytes)")
            raw = f.read(length)
    except OSError as exc:
        raise SpecplayError(f"{file}: cannot read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise SpecplayError(f"{file}: corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise SpecplayError(f"{file}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - length
    return {name: _tensor_info(name, entry, file, data_bytes) for name, entry in header.items()}


def _tensor_info(name: str, entry: Any, file: Path, data_bytes: int) -> TensorInfo:
    bad = SpecplayError(f"{file}: corrupt safetensors header entry for {name!r}")
    if not isinstance(entry, dict):
        raise bad
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(dtype, str) and isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
        raise bad
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise bad
    info = TensorInfo(tuple(shape), dtype, file)
    begin, end = offsets
    itemsize = ST_ITEMSIZE.get(dtype)
    if not 0 <= begin <= end or (itemsize is not None and end - begin != info.numel * itemsize):
        raise SpecplayError(f"{file}: the header gives {name!r} {end - begin} bytes for shape {list(shape)} "
                            f"{dtype} (corrupt file)")
    if end > data_bytes:
        raise SpecplayError(f"{file}: truncated ({name!r} ends at byte {end} of {data_bytes} data bytes); "
                            "download it again")
    return info


def safetensors_files(root: Path) -> List[Path]:
    """model.safetensors, or the shards named by model.safetensors.index.json; [] when there is neither."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SpecplayError(f"{index}: corrupt safetensors index ({type(exc).__name__}: {exc})") from None
        if not names or not all(isinstance(n, str) and n and "/" not in n and "\\" not in n for n in names):
            raise SpecplayError(f"{index}: corrupt safetensors index (bad shard names)")
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise SpecplayError(f"{index}: shard {missing[0]} is missing "
                                f"({len(missing)} of {len(names)} missing)")
        return [root / n for n in names]
    single = root / "model.safetensors"
    return [single] if single.is_file() else []


def read_checkpoint_header(root: Path) -> Dict[str, TensorInfo]:
    """Every tensor of the folder's safetensors checkpoint (all shards), from the headers only."""
    tensors: Dict[str, TensorInfo] = {}
    for file in safetensors_files(root):
        tensors.update(read_safetensors_header(file))
    return tensors


# ------------------------------------------------------------------------------------------------------------
# Llama-family shapes


class Dim(NamedTuple):
    """One expected dimension and the config.json fields it comes from (for the error message)."""

    size: int
    label: str


def llama_expected_shapes(spec: Any) -> Dict[str, Tuple[Dim, ...]]:
    """name -> expected shape of every tensor the compact forward reads (LlamaForCausalLM names)."""
    s = spec
    hid, inter = Dim(s.hidden_size, "hidden_size"), Dim(s.intermediate_size, "intermediate_size")
    q = Dim(s.num_heads * s.head_dim, "num_attention_heads × head_dim")
    kv = Dim(s.num_kv_heads * s.head_dim, "num_key_value_heads × head_dim")
    shapes: Dict[str, Tuple[Dim, ...]] = {
        "model.embed_tokens.weight": (Dim(s.vocab_size, "vocab_size"), hid), "model.norm.weight": (hid,)}
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        shapes.update({
            p + "input_layernorm.weight": (hid,), p + "post_attention_layernorm.weight": (hid,),
            a + "q_proj.weight": (q, hid), a + "k_proj.weight": (kv, hid), a + "v_proj.weight": (kv, hid),
            a + "o_proj.weight": (hid, q),
            m + "gate_proj.weight": (inter, hid), m + "up_proj.weight": (inter, hid),
            m + "down_proj.weight": (hid, inter),
        })
        if s.attention_bias:
            shapes.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)})
        if getattr(s, "qk_norm", False):  # Qwen3: one RMSNorm weight per head dimension for q and for k
            head = Dim(s.head_dim, "head_dim")
            shapes.update({a + "q_norm.weight": (head,), a + "k_norm.weight": (head,)})
        if s.o_bias:
            shapes[a + "o_proj.bias"] = (hid,)
        if s.mlp_bias:
            shapes.update({m + "gate_proj.bias": (inter,), m + "up_proj.bias": (inter,),
                           m + "down_proj.bias": (hid,)})
    return shapes


def normalise_llama_names(tensors: Mapping[str, Any]) -> Dict[str, Any]:
    """Some exports drop the "model." prefix; map every name to the LlamaForCausalLM spelling."""
    return {(k if k.startswith(("model.", "lm_head.")) else "model." + k): v for k, v in tensors.items()}


def check_llama_checkpoint(spec: Any, header: Mapping[str, TensorInfo],
                           cfg_path: Path) -> Dict[str, TensorInfo]:
    """Every tensor the forward reads exists, is a float tensor and has the shape config.json implies.
    Returns name -> TensorInfo of those tensors (lm_head included when the model reads its own)."""
    tensors = normalise_llama_names(header)
    expected = llama_expected_shapes(spec)
    own_head = "lm_head.weight" in tensors or spec.tie_word_embeddings is False
    if spec.tie_word_embeddings is not True and own_head:
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    used: Dict[str, TensorInfo] = {}
    for name, dims in expected.items():
        info = tensors.get(name)
        if info is None:
            where = f" (config.json: num_hidden_layers {spec.num_layers})" if ".layers." in name else ""
            raise SpecplayError(f"{cfg_path.parent}: weight {name!r} missing from the checkpoint{where}")
        if info.dtype not in FLOAT_DTYPES:
            raise SpecplayError(f"{info.file}: {name} is stored as {info.dtype}; the compact forward reads "
                                "float weights only (quantized checkpoints need a quantization_config)")
        if info.shape != tuple(d.size for d in dims):
            implied = ", ".join(f"{d.label} {d.size}" for d in dims)
            raise SpecplayError(f"{info.file}: {name} has shape {list(info.shape)} but {cfg_path} implies "
                                f"[{implied}]")
        used[name] = info
    return used


def check_llama_config(spec: Any, config: Mapping[str, Any], cfg_path: Path) -> None:
    """Values of a Llama-family config checked against each other."""
    if spec.num_heads % spec.num_kv_heads:
        raise SpecplayError(f"{cfg_path}: num_key_value_heads {spec.num_kv_heads} does not divide "
                            f"num_attention_heads {spec.num_heads}")
    implied_head_dim = config.get("head_dim") is None and spec.model_type != "qwen3"  # Qwen3's default: 128
    if implied_head_dim and spec.hidden_size != spec.num_heads * spec.head_dim:
        raise SpecplayError(f"{cfg_path}: hidden_size {spec.hidden_size} is not num_attention_heads "
                            f"{spec.num_heads} × head_dim (without a head_dim it must be a multiple)")
    types = config.get("layer_types")
    if types is not None and not (isinstance(types, list) and len(types) == spec.num_layers):
        raise SpecplayError(f"{cfg_path}: layer_types must list one attention type for each of the "
                            f"{spec.num_layers} layers")
    if spec.head_dim % 2:
        raise SpecplayError(f"{cfg_path}: head_dim {spec.head_dim} must be even (rotary embeddings)")
    check_rope({"rope_theta": spec.rope_theta, **spec.rope}, cfg_path)


# ------------------------------------------------------------------------------------------------------------
# Memory


@dataclass
class MemoryEstimate:
    weights: int  # bytes of the loaded weights, in the runner dtype
    loading: int  # extra bytes held while loading (the checkpoint's tensors before conversion and fusion)
    kv_cache: int
    rope: int  # rotary tables and their float32 temporaries

    @property
    def peak(self) -> int:
        return max(self.loading, self.weights) + self.kv_cache + self.rope

    def describe(self) -> str:
        parts = (("weights", self.weights), ("KV cache", self.kv_cache), ("rotary tables", self.rope))
        return ", ".join(f"{name} {n / GIB:.2f} GiB" for name, n in parts)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def llama_memory(spec: Any, header: Mapping[str, TensorInfo], used: Mapping[str, TensorInfo],
                 dtype: torch.dtype, max_length: int) -> MemoryEstimate:
    item = dtype_bytes(dtype)
    weights = sum(info.numel for info in used.values()) * item
    layer = max((sum(i.numel for n, i in used.items() if n.startswith(f"model.layers.{li}."))
                 for li in range(spec.num_layers)), default=0) * item
    checkpoint = sum(info.nbytes for info in header.values())
    kv = spec.num_layers * 2 * spec.num_kv_heads * max_length * spec.head_dim * item
    rope = max_length * spec.head_dim * (2 * item + 3 * 4)
    return MemoryEstimate(weights, checkpoint + layer, kv, rope)


def free_memory(device: torch.device) -> Optional[int]:
    """Bytes free for new allocations on device (None when unknown)."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    if device.type != "cpu":
        return None
    free = [v for v in (_meminfo_available(), _cgroup_free()) if v is not None]
    if free:
        return min(free)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _meminfo_available() -> Optional[int]:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_free() -> Optional[int]:
    """Room left under a cgroup v2 memory limit (containers), or None."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
    except (OSError, ValueError):
        return None


def check_memory(estimate: MemoryEstimate, device: torch.device, model_dir: Path, max_length: int) -> None:
    free = free_memory(device)
    if free is None or estimate.peak <= free:
        return
    raise SpecplayError(
        f"{model_dir}: loading needs about {estimate.peak / GIB:.2f} GiB ({estimate.describe()}, for a "
        f"context of {max_length} tokens) but only {free / GIB:.2f} GiB is free on {device}"
    )


# ------------------------------------------------------------------------------------------------------------
# Generic (transformers) models


def one_line(exc: BaseException, limit: int = 300) -> str:
    """A library's exception as one short line: its lines joined, long messages cut."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"


def check_model_type(config: Mapping[str, Any], cfg_path: Path, known: Iterable[str]) -> None:
    """model_type must name an architecture built into transformers: code shipped with a model (auto_map) is
    never run, so a model that needs it cannot load."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise SpecplayError(f"{cfg_path}: no model_type (not a transformers model config)")
    if model_type in set(known):
        return
    if config.get("auto_map"):
        raise SpecplayError(f"{cfg_path}: model_type {model_type!r} needs the model's own code (auto_map); "
                            "specplay never runs code shipped with a model (trust_remote_code stays off)")
    raise SpecplayError(f"{cfg_path}: model_type {model_type!r} is not an architecture this transformers "
                        "knows (a newer release may)")


def check_against_header(expected: Mapping[str, Tuple[int, ...]], header: Mapping[str, TensorInfo],
                         prefix: str, cfg_path: Path) -> None:
    """Shapes a model built from config.json expects vs the checkpoint's, for the names both have (with or
    without the base model's prefix: older exports drop it)."""
    for name, shape in expected.items():
        info = header.get(name)
        if info is None and prefix and name.startswith(prefix + "."):
            info = header.get(name[len(prefix) + 1:])
        if info is not None and info.shape != tuple(shape):
            raise SpecplayError(f"{info.file}: {name} has shape {list(info.shape)} but {cfg_path} implies "
                                f"{list(shape)}")


def generic_memory(param_numel: int, header: Mapping[str, TensorInfo], config: Any, dtype: torch.dtype,
                   max_length: int) -> MemoryEstimate:
    """Weights from the model's parameter count, a KV cache of max_length tokens for every layer."""
    item = dtype_bytes(dtype)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(config, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(config, "head_dim", 0) or (hidden // heads if heads else 0))
    kv_width = kv_heads * head_dim or hidden
    kv = layers * 2 * kv_width * max_length * item
    return MemoryEstimate(param_numel * item, sum(i.nbytes for i in header.values()), kv, 0)


# ------------------------------------------------------------------------------------------------------------
# Draft heads (EAGLE, EAGLE-3, Medusa): read beside the target, checked like its weights before allocation

MAX_HEAD_CONFIG_BYTES = 1 << 20
MAX_MEDUSA_HEADS = 64
MAX_TAP_LAYERS = 16


def read_head_config(cfg_path: Path, what: str) -> Dict[str, Any]:
    """A head's JSON config (bounded read), its sizes checked against SIZE_LIMITS (head_dim 10^7 fails
    here, before any table is built)."""
    from engine.files import bounded

    text = bounded.read_text(cfg_path, f"the {what} config", MAX_HEAD_CONFIG_BYTES)
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise SpecplayError(f"{cfg_path}: the {what} config is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise SpecplayError(f"{cfg_path}: the {what} config is not a JSON object")
    check_config_values(config, cfg_path)
    return config


def head_files(model_dir: Path, head_file: str, config_file: str, what: str) -> Tuple[Path, Path]:
    """(config path, tensors path) of a head, or one line saying the folder has none."""
    cfg_path, head_path = model_dir / config_file, model_dir / head_file
    if not (cfg_path.is_file() and head_path.is_file()):
        raise SpecplayError(f"{model_dir} has no {what} ({head_file} + {config_file})")
    return cfg_path, head_path


def check_head_tensors(header: Mapping[str, TensorInfo], expected: Mapping[str, Tuple[int, ...]],
                       head_path: Path, what: str, quantized: Iterable[str] = ()) -> None:
    """Every tensor the head reads exists, is a float tensor (int8 where `quantized` names it, with its
    scale) and has the shape the target and the head's config imply."""
    quantized = set(quantized)
    for name, shape in expected.items():
        info = header.get(name)
        if info is None:
            raise SpecplayError(f"{head_path}: {name} missing (the {what} needs it)")
        int8 = name in quantized and info.dtype == "I8"
        if info.dtype not in FLOAT_DTYPES and not int8:
            raise SpecplayError(f"{head_path}: {name} is stored as {info.dtype} (float expected)")
        if info.shape != tuple(shape):
            raise SpecplayError(f"{head_path}: {name} has shape {list(info.shape)}, expected {list(shape)} "
                                "for this target and head config")
        if int8:
            scale = name.removesuffix(".weight") + ".weight_scale"
            check_head_tensors(header, {scale: shape[:1]}, head_path, what)


def eagle_head_shapes(spec: Any, taps: int = 0) -> Dict[str, Tuple[int, ...]]:
    """name -> shape of an EAGLE head's tensors: fc [H, 2H], its decoder layer ("layer." + the Llama
    names of layer 0) and, for EAGLE-3, proj [H, taps × H]."""
    hidden = spec.hidden_size
    shapes = {"fc.weight": (hidden, 2 * hidden)}
    prefix = "model.layers.0."
    for name, dims in llama_expected_shapes(spec).items():
        if name.startswith(prefix):
            shapes["layer." + name[len(prefix):]] = tuple(d.size for d in dims)
    if taps:
        shapes["proj.weight"] = (hidden, taps * hidden)
    return shapes


def check_tap_layers(config: Mapping[str, Any], target_layers: Optional[int], cfg_path: Path) -> tuple:
    """EAGLE-3's tap_layers: 1..MAX_TAP_LAYERS layer indices of the target."""
    taps = config.get("tap_layers")
    if not (isinstance(taps, list) and 1 <= len(taps) <= MAX_TAP_LAYERS and all(_is_int(t) for t in taps)):
        raise SpecplayError(f"{cfg_path}: tap_layers must list 1 to {MAX_TAP_LAYERS} target layer indices "
                            f"(got {str(taps)[:60]})")
    if target_layers is not None and not all(0 <= t < target_layers for t in taps):
        raise SpecplayError(f"{cfg_path}: tap layers {taps} outside the target's {target_layers} layers")
    return tuple(taps)


def medusa_head_shapes(config: Mapping[str, Any], hidden: int, cfg_path: Path) -> Dict[str, Tuple[int, ...]]:
    """name -> shape of Medusa's tensors for the head config (num_heads, layers) on a target of hidden size
    `hidden`: each head's [H, H] weight and [H] bias, and a second block's where layers is 2."""
    count, layers = config.get("num_heads"), config.get("layers", 1)
    if not (_is_int(count) and 1 <= count <= MAX_MEDUSA_HEADS):
        raise SpecplayError(f"{cfg_path}: num_heads must be an integer in 1..{MAX_MEDUSA_HEADS} "
                            f"(got {count!r})")
    if layers not in (1, 2) or isinstance(layers, bool):
        raise SpecplayError(f"{cfg_path}: layers must be 1 or 2 (got {layers!r})")
    shapes = {}
    for block in ("heads", "second")[:layers]:
        for i in range(count):
            shapes.update({f"{block}.{i}.weight": (hidden, hidden), f"{block}.{i}.bias": (hidden,)})
    return shapes
