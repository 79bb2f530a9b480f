"""Draft heads in their published layouts (EAGLE-1/2, EAGLE-3, Medusa), read from their own folder.

The layout is detected from the folder's config.json (engine.methods.<method>.public build the heads); every
tensor's name and shape is checked against the loaded target from the weights file's header (safetensors) or
a weights-only torch.load (pytorch_model.bin, medusa_lm_head.pt) before anything is allocated on the device.
HeadLayer is the one decoder layer these heads run, in plain torch with its own KV cache: the published
layers differ from the target's (EAGLE-1's layer 0 has no input norm, EAGLE-3's attention reads 2H inputs).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from engine.errors import SpecplayError
from engine.kernels.step import ATTENTION_MAX_D, HALF_DTYPES, gemv_fits
from engine.models import validate
from engine.models.llama import (
    DECODE_GEMV_ROWS,
    KV_BUCKET,
    apply_rope,
    block_columns,
    rms_norm,
    rope_tables,
)
from engine.models.runner import ForwardOutput

EAGLE3_ARCHITECTURES = {"LlamaForCausalLMEagle3": "EAGLE-3 (SpecForge)",
                        "Eagle3LlamaForCausalLM": "EAGLE-3 (vLLM / AngelSlim)"}
MAX_HEAD_LAYERS = 2  # Medusa residual blocks a head (the published heads have 1)


@dataclass
class HeadsInfo:
    """What a heads folder holds, as detected from its config.json (nothing is loaded yet)."""

    folder: Path
    layout: str  # e.g. "EAGLE-3 (speculators)"
    method: str  # the method that runs them: eagle | eagle3 | medusa
    config: dict
    weights: Path
    trained_for: Optional[str] = None  # the target named by the config (speculators' verifier)
    taps: Optional[tuple] = None  # EAGLE-3: the tapped layers as written
    draft_vocab: Optional[int] = None
    notes: list = field(default_factory=list)  # one line each, shown with the summary

    @property
    def methods(self) -> tuple:
        """The registry methods that run these heads."""
        return ("medusa", "medusa-fixed") if self.method == "medusa" else (self.method,)

    def describe(self) -> str:
        lines = [f"heads: {self.folder}", f"layout: {self.layout} (method {self.method})",
                 f"trained for: {self.trained_for or 'not stated'}"]
        if self.taps is not None:
            lines.append(f"tapped layers: {list(self.taps)} (transformers' hidden_states[k]: the residual "
                         "stream before layer k)")
        if self.draft_vocab is not None:
            lines.append(f"draft vocabulary: {self.draft_vocab} tokens")
        return "\n".join(lines + self.notes)


def resolve_heads_dir(path_or_id) -> Path:
    """A local heads folder or a Hub id already in the HF cache (nothing is downloaded)."""
    from engine.models.loading import resolve_model_dir

    return resolve_model_dir(path_or_id)


def detect(path_or_id) -> HeadsInfo:
    """The layout of the heads in this folder, from its config.json; one line when it is none we know."""
    folder = resolve_heads_dir(path_or_id)
    cfg_path = folder / "config.json"
    config = validate.read_head_config(cfg_path, "heads")
    if config.get("speculators_model_type") is not None:
        return _speculators(folder, config, cfg_path)
    arch = next((a for a in config.get("architectures") or () if a in EAGLE3_ARCHITECTURES), None)
    if arch is not None or "draft_vocab_size" in config:
        layout = EAGLE3_ARCHITECTURES.get(arch, "EAGLE-3 (SpecForge)")
        return _eagle3_info(folder, config, layout, config.get("base_model_name_or_path"))
    if "medusa_num_heads" in config:
        weights = _first_file(folder, ("medusa_lm_head.safetensors", "medusa_lm_head.pt"), "Medusa heads")
        return HeadsInfo(folder, "Medusa-1 (FasterDecoding)", "medusa", config, weights,
                         config.get("base_model_name_or_path"))
    if config.get("model_type") == "medusa":
        weights = _first_file(folder, ("model.safetensors", "pytorch_model.bin"), "Medusa heads")
        return HeadsInfo(folder, "Medusa (vLLM)", "medusa", config, weights,
                         config.get("base_model_name_or_path"))
    if config.get("num_hidden_layers") == 1:
        weights = _first_file(folder, ("model.safetensors", "pytorch_model.bin"), "EAGLE head")
        return HeadsInfo(folder, "EAGLE-1/2 (SafeAILab)", "eagle", config, weights,
                         config.get("base_model_name_or_path"))
    raise SpecplayError(f"{cfg_path}: no known head layout (EAGLE-1/2 with num_hidden_layers 1, EAGLE-3, "
                        "speculators eagle3, Medusa with medusa_num_heads or model_type medusa)")


def _speculators(folder: Path, config: dict, cfg_path: Path) -> HeadsInfo:
    kind = config.get("speculators_model_type")
    if kind != "eagle3":
        raise SpecplayError(f"{cfg_path}: speculators_model_type {str(kind)[:40]!r} is not supported "
                            "(eagle3 is)")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise SpecplayError(f"{cfg_path}: transformer_layer_config must be an object")
    validate.check_config_values(layer, cfg_path)
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {})
    trained_for = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    return _eagle3_info(folder, config, "EAGLE-3 (speculators)", trained_for)


def _eagle3_info(folder: Path, config: dict, layout: str, trained_for) -> HeadsInfo:
    weights = _first_file(folder, ("model.safetensors", "pytorch_model.bin"), "EAGLE-3 head")
    eagle_config = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    key = "eagle_aux_hidden_state_layer_ids"
    taps = config.get(key, eagle_config.get(key))
    info = HeadsInfo(folder, layout, "eagle3", config, weights, trained_for,
                     None if taps is None else tuple(taps) if isinstance(taps, list) else taps,
                     config.get("draft_vocab_size"))
    if taps is None:
        info.notes.append("tapped layers: not in the config; the published default (2, L//2, L-3)")
    return info


def _first_file(folder: Path, names: tuple, what: str) -> Path:
    for name in names:
        if (folder / name).is_file():
            return folder / name
    raise SpecplayError(f"{folder}: no {what} weights ({' or '.join(names)})")


# ------------------------------------------------------------------------------------------------ weights


def read_header(weights: Path) -> Dict[str, validate.TensorInfo]:
    """name -> TensorInfo of every tensor, from a safetensors header, or from a weights-only torch.load
    (memory-mapped: only the header-sized metadata is touched) of a .bin / .pt file."""
    if weights.suffix == ".safetensors":
        return validate.read_safetensors_header(weights)
    tensors = _torch_load(weights)
    return {name: validate.TensorInfo(tuple(t.shape), _st_dtype(t.dtype), weights)
            for name, t in tensors.items()}


def _st_dtype(dtype: torch.dtype) -> str:
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL", torch.int8: "I8"}
    return names.get(dtype, str(dtype))


def _torch_load(weights: Path) -> dict:
    """A weights-only torch.load (never unpickling code), memory-mapped where the file allows."""
    try:
        try:
            tensors = torch.load(str(weights), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:  # the legacy (non-zip) format cannot be memory-mapped
            if "mmap" not in str(exc):
                raise
            tensors = torch.load(str(weights), map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError, EOFError, zip errors: a bad or hostile file
        raise SpecplayError(f"{weights}: cannot read the weights ({validate.one_line(exc)})") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise SpecplayError(f"{weights}: not a dictionary of tensors")
    return tensors


def load_tensors(weights: Path, names, device, dtype) -> Dict[str, torch.Tensor]:
    """The named tensors (only those) on the device; floats in dtype, integer tensors kept as they are."""
    names = set(names)
    if weights.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(weights), framework="pt", device="cpu") as f:
                tensors = {name: f.get_tensor(name) for name in names}
        except Exception as exc:  # noqa: BLE001 - a corrupt file, one line
            raise SpecplayError(f"{weights}: cannot read the weights ({validate.one_line(exc)})") from None
    else:
        tensors = {name: t for name, t in _torch_load(weights).items() if name in names}
    return {name: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
            for name, t in tensors.items()}


def check_shapes(header, expected: Dict[str, Tuple[int, ...]], weights: Path, what: str) -> None:
    """Every expected tensor exists as a float tensor of its shape (validate.check_head_tensors)."""
    validate.check_head_tensors(header, expected, weights, what)


def check_positive(config: dict, names, cfg_path: Path, limit: int = 1 << 17) -> None:
    """Each named config field is an integer in 1..limit."""
    for name in names:
        value = config.get(name)
        if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= limit):
            raise SpecplayError(f"{cfg_path}: {name} must be an integer in 1..{limit} "
                                f"(got {str(value)[:40]})")


# ------------------------------------------------------------------------------------------------ the layer


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float


class HeadLayer:
    """One Llama decoder layer with its own KV cache (the published heads' layer): torch's operations, or in
    bf16 on CUDA the target's decode kernels (kernels_for).

    prepare(x [n, W]) -> (attention input [n, A], residual [n, H]): EAGLE-1's layer 0 reads x itself (no
    input norm), EAGLE-3's reads [input_layernorm(embedding) | hidden_norm(g)] of width 2H. readout(hidden
    [n, H]) -> logits [n, V] float32 over the target's ids. It offers what EAGLE's drafter asks of a head
    runner (forward_embeds, step_embeds for its trees, reset, rollback, length), and what a captured draft
    chain and a replayed round ask (engine.core.graphs: use_graphs, pool_handle, chain_block, kv_width,
    decode_path, block_step): block_step reads the block's start on the device only, so that the head's step
    and chain, and the whole round with the target's verification, are captured as for the project's heads."""

    supports_tree = True
    decode_kernels = None  # (EagleHead's fusion reads a runner's; a published head's fc keeps torch's)

    def __init__(self, weights: Dict[str, torch.Tensor], shape: LayerShape, inv_freq: torch.Tensor,
                 prepare: Callable, readout: Callable, max_length: int, step_kernels=None):
        # q, k, v [heads*D | kv_heads*D, A], o [H, heads*D], gate, up [I, H], down [H, I], post_norm [H]
        self.shape = shape
        self.prepare, self.readout = prepare, readout
        self.device, self.dtype = weights["q"].device, weights["q"].dtype
        self.w = fuse_products(weights)
        self.max_length = max_length
        # [max_length, D] each, as apply_rope and sp_rope_qkv take them
        self.cos, self.sin_signed = rope_tables(inv_freq.to(self.device), max_length, self.dtype)
        self.kv = torch.zeros(2, shape.kv_heads, max_length, shape.head_dim, dtype=self.dtype,
                              device=self.device)  # [2, kvh, max_length, D]
        self._length = 0
        self._arange = torch.arange(max_length, device=self.device)  # [max_length], sliced for rows, columns
        self._chains: Dict[int, tuple] = {}  # n -> (depth [n], visible [n, n] bool) of a chain on the device
        self.use_graphs = False  # captured chains (SpeculativeDecoder.set_cuda_graphs turns them on on CUDA)
        self.pool_handle = None  # the memory pool of its captured graphs (engine.core.graphs.graph_pool)
        # the target's decode kernels (engine.kernels.step.StepKernels, or None): block_step runs on them
        # where they take the block (kernels_for)
        self.step_kernels = step_kernels
        self._kernels_ok: Dict[int, bool] = {}  # block rows -> whether every product fits sp_gemv

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        self._length = 0

    def rollback(self, length: int) -> None:
        self._length = min(self._length, int(length))

    def set_length(self, length: int) -> None:
        self._length = int(length)

    def kv_width(self, rows: int) -> int:
        """The attention width of a step reaching cache row rows - 1, rounded up to a bucket (as LlamaRunner's
        on the GPU): one captured chain, keyed by (K, kv), then serves many cache lengths."""
        return min(self.max_length, -(-int(rows) // KV_BUCKET) * KV_BUCKET)

    def decode_path(self, n: int) -> bool:
        """Every block can read its start on the device (block_step at kv 0 attends over the whole cache,
        masked past the block): the whole-round graphs (eagle_round, EagleRoundGraph, the tree rounds) take
        these heads as they take the project's own, and a round is one replay."""
        return True

    def takes_tree_levels(self, rows: int, nodes: int) -> bool:
        return False

    def use_torch_twins(self) -> None:
        """Run the layer in torch's operations only (engine.tuning: SPECPLAY_TORCH_TWINS=1)."""
        self.step_kernels = None

    def kernels_for(self, n: int):
        """The decode kernels where a block of n rows runs on them (bf16/fp16 on CUDA, every product in
        sp_gemv's staging, a head dim the attention kernel reads), else None."""
        kernels = self.step_kernels
        if kernels is None or self.dtype not in HALF_DTYPES:
            return None
        if n not in self._kernels_ok:
            products = [self.w[name] for name in ("qkv", "o", "gate_up", "down")]
            d = self.shape.head_dim
            self._kernels_ok[n] = (n <= DECODE_GEMV_ROWS and d % 8 == 0 and d <= ATTENTION_MAX_D
                                   and all(gemv_fits(w, n) for w in products))
        return kernels if self._kernels_ok[n] else None

    def forward_embeds(self, x: torch.Tensor, parents: Optional[torch.Tensor] = None) -> ForwardOutput:
        """Append n positions (inputs x [n, W]) after the cache: a chain, or a tree by its parents [n]. A
        chain's mask and positions are made on the device: no copy from the host waits for the GPU between
        draft steps."""
        n, start = x.shape[0], self._length
        if start + n > self.max_length:
            raise SpecplayError(f"the head's cache holds {self.max_length} positions")
        rows = torch.arange(start, start + n, device=self.device)  # [n] cache rows
        if parents is None:
            visible, positions = self.chain_block(n)[1], rows
        else:
            from engine.models.runner import tree_ancestor_mask, tree_depths

            visible = tree_ancestor_mask(parents.cpu()).to(self.device)
            positions = start + tree_depths(parents.cpu()).to(self.device)
        mask = torch.zeros(n, start + n, dtype=torch.float32, device=self.device)  # [n, kv] additive
        mask[:, start:] = torch.where(visible, 0.0, float("-inf"))
        hidden = self.step_embeds(x, positions, rows, mask)
        self._length = start + n
        return ForwardOutput(self.readout(hidden), hidden)

    def chain_block(self, n: int) -> tuple:
        """A chain of n on the device: (depth [n] = 0..n-1, visible [n, n] bool: row i sees rows 0..i), kept
        per n (made before a capture, not inside one)."""
        if n not in self._chains:
            self._chains[n] = (torch.arange(n, device=self.device),
                               torch.ones(n, n, dtype=torch.bool, device=self.device).tril())
        return self._chains[n]

    def block_step(self, x: torch.Tensor, start: torch.Tensor, depth: torch.Tensor,
                   block_visible: torch.Tensor, kv: int) -> tuple:
        """x [n, W] written at cache rows start..start+n-1 (start: [1] int64 on the device, never read on the
        host: this runs inside a CUDA graph's capture) at positions start + depth [n], attending over cache
        rows 0..kv-1 as block_mask says. The host's length stays as it was (the caller sets it). Returns
        (hidden [n, H], logits [n, V] float32). kv 0 (the decode path): the whole cache."""
        n, kv = x.shape[0], kv or self.max_length
        kernels = self.kernels_for(n)
        if kernels is not None:
            hidden = self._kernel_step(kernels, x, start, depth, block_visible)
            return hidden, self.readout(hidden)
        rows = start + self._arange[:n]  # [n] cache rows
        mask = self.block_mask(start, block_visible, kv)  # [n, kv]
        hidden = self.step_embeds(x, start + depth, rows, mask)  # [n, H]
        return hidden, self.readout(hidden)

    def _kernel_step(self, kernels, x: torch.Tensor, start: torch.Tensor, depth: torch.Tensor,
                     block_visible: torch.Tensor) -> torch.Tensor:
        """step_embeds on the target's decode kernels, as LlamaRunner's layers run there: one sp_gemv a
        product (the residuals, the post-attention norm and SiLU * up fused in), sp_rope_qkv (the cache rows
        start + i written), sp_attention over the cache and the block. A draft step is then a few launches,
        not the thirty of torch's operations. x [n, W] -> [n, H]."""
        s, w = self.shape, self.w
        attn_in, residual = self.prepare(x.to(self.dtype))
        qkv = kernels.gemv(attn_in.contiguous(), w["qkv"], w.get("qkv_bias"))  # [n, (heads + 2 kvh) * D]
        q = kernels.rope_qkv(qkv, self.cos, self.sin_signed, depth.long().contiguous(), None, self.kv[0],
                             self.kv[1], s.heads, s.kv_heads, chained=True, start=start)  # [heads, n, D]
        attn = kernels.attention(q, self.kv[0], self.kv[1], start, block_visible.contiguous(), chained=True)
        return kernels.after_attention(attn, residual.contiguous(), w["o"], w["gate_up"], w["post_norm"],
                                       s.eps, w["down"])

    def block_mask(self, start: torch.Tensor, block_visible: torch.Tensor, kv: int) -> torch.Tensor:
        """The additive mask [n, kv] float32 of a block at cache row start ([1] on the device), 0 where
        block_columns says the row sees the column, -inf elsewhere. Static shapes, made on the device."""
        n = block_visible.shape[0]
        cols = self._arange[:kv]  # [kv]
        if n == 1:  # a chain's step (its one row sees itself): two launches, not eleven
            return torch.where(cols <= start, 0.0, float("-inf"))[None]  # [1, kv] float32
        visible = block_columns(cols, start, block_visible)[0]  # [n, kv]
        mask = torch.zeros(n, kv, dtype=torch.float32, device=self.device)
        return mask.masked_fill_(~visible, float("-inf"))

    def step_embeds(self, x: torch.Tensor, positions: torch.Tensor, cache_index: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
        """x [n, W] at these positions [n], K/V written at cache rows cache_index [n]; mask [n, kv] additive
        over cache rows 0..kv-1. Returns the layer's output [n, H]."""
        s, w = self.shape, self.w
        n, kv = x.shape[0], mask.shape[-1]
        q_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim
        attn_in, residual = self.prepare(x.to(self.dtype))
        q, k, v = F.linear(attn_in, w["qkv"], w.get("qkv_bias")).split((q_width, kv_width, kv_width), dim=-1)
        cos, sin_signed = self.cos[positions][:, None], self.sin_signed[positions][:, None]  # [n, 1, D]
        q = apply_rope(q.reshape(n, s.heads, s.head_dim), cos, sin_signed)  # [n, heads, D]
        k = apply_rope(k.reshape(n, s.kv_heads, s.head_dim), cos, sin_signed)  # [n, kvh, D]
        self.kv[0].index_copy_(1, cache_index, k.transpose(0, 1).to(self.dtype))
        self.kv[1].index_copy_(1, cache_index, v.reshape(n, s.kv_heads, s.head_dim).transpose(0, 1))
        attn = F.scaled_dot_product_attention(  # [1, heads, n, D]
            q.transpose(0, 1)[None], self.kv[0, :, :kv][None], self.kv[1, :, :kv][None],
            attn_mask=mask.to(q.dtype)[None, None], enable_gqa=s.heads != s.kv_heads)
        h = residual + F.linear(attn[0].transpose(0, 1).reshape(n, q_width), w["o"])
        gate, up = F.linear(rms_norm(h, w["post_norm"], s.eps), w["gate_up"]).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, w["down"])


def fuse_products(weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The layer's tensors with q, k, v side by side as one product (qkv [heads*D + 2 kvh*D, A], with
    qkv_bias where the layer has biases) and gate, up as one (gate_up [2I, H]): fewer launches a step."""
    w = dict(weights)
    products = [w.pop(name) for name in ("q", "k", "v")]
    w["qkv"] = torch.cat(products)
    biases = [w.pop(f"{name}_bias", None) for name in ("q", "k", "v")]
    if any(b is not None for b in biases):  # a missing one is zeros
        w["qkv_bias"] = torch.cat([b if b is not None else p.new_zeros(p.shape[0])
                                   for b, p in zip(biases, products)])
    w["gate_up"] = torch.cat([w.pop("gate"), w.pop("up")])
    return w


def layer_weights(tensors: Dict[str, torch.Tensor], prefix: str) -> Dict[str, torch.Tensor]:
    """The Llama layer's tensors under prefix (e.g. "layers.0.") in HeadLayer's names."""
    names = {"q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
             "o": "self_attn.o_proj.weight", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
             "down": "mlp.down_proj.weight", "post_norm": "post_attention_layernorm.weight",
             "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
             "v_bias": "self_attn.v_proj.bias"}
    return {short: tensors[prefix + long] for short, long in names.items() if prefix + long in tensors}


def layer_shapes(prefix: str, shape: LayerShape, inputs: int, intermediate: int) -> Dict[str, tuple]:
    """The Llama layer's tensors under prefix and their shapes (q/k/v read `inputs` features)."""
    q, kv, hidden = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden
    return {f"{prefix}self_attn.q_proj.weight": (q, inputs), f"{prefix}self_attn.k_proj.weight": (kv, inputs),
            f"{prefix}self_attn.v_proj.weight": (kv, inputs), f"{prefix}self_attn.o_proj.weight": (hidden, q),
            f"{prefix}mlp.gate_proj.weight": (intermediate, hidden),
            f"{prefix}mlp.up_proj.weight": (intermediate, hidden),
            f"{prefix}mlp.down_proj.weight": (hidden, intermediate),
            f"{prefix}post_attention_layernorm.weight": (hidden,)}


def layer_config(config: dict, cfg_path: Path, hidden_default: int) -> tuple:
    """(LayerShape, intermediate size, rotary inverse frequencies [D/2]) from a Llama-style config."""
    from engine.models.llama import LlamaSpec, rope_inv_freq

    check_positive(config, ("num_attention_heads", "intermediate_size"), cfg_path)
    merged = {"model_type": "llama", "vocab_size": 1, "num_hidden_layers": 1,
              "hidden_size": hidden_default, **config}
    merged["model_type"] = "llama"
    try:
        spec = LlamaSpec.from_dict(merged)
    except (KeyError, ValueError, TypeError) as exc:
        raise SpecplayError(f"{cfg_path}: {validate.one_line(exc)}") from None
    shape = LayerShape(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps)
    return shape, spec.intermediate_size, rope_inv_freq(spec)
