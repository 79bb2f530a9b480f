"""Any transformers causal LM (GPT-2, Phi, ...) behind the `CausalRunner` interface; chains only.

This is the fallback for models that `engine.models.llama.LlamaRunner` does not cover. It uses a
`DynamicCache` and
rolls back by cropping it. transformers changes this API between releases, and this module owns that churn:

- the forward's cache keyword is `past_key_values` in older releases and `cache` in newer 5.x ones: it is read
  from the forward's signature (`_cache_kwarg`);
- `DynamicCache.crop(n)` took an absolute length in 4.x and takes only a negative count (tokens to remove) in
  newer 5.x: `crop_cache` uses the negative form (which both understand), checks the resulting length, tries
  the other convention, and as a last resort slices the per-layer key/value tensors itself.

Before loading, `validated_config` checks config.json (sizes, a model_type transformers knows: code shipped
with a model is never run) and builds the model on the meta device, which costs no memory, to compare its
shapes with the safetensors headers and to estimate the memory it needs; after loading, weights transformers
would have started from random values (missing from the checkpoint) are an error.

Features (`ForwardOutput.hidden`) are the last entry of `output_hidden_states`, which for most transformers
models (GPT-2 included) is taken AFTER the final norm, unlike `LlamaRunner`'s pre-norm features.
`logits_from_hidden` therefore applies only the output embedding (`get_output_embeddings()`), so that
`logits_from_hidden(forward(x).hidden) == forward(x).logits` for models whose head is a plain linear layer;
models with extra logit processing (soft-capping, logit scales) are approximated.
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from engine.errors import SpecplayError
from engine.models import validate
from engine.models.runner import CausalRunner, ForwardOutput, fill_unknown

DEFAULT_MAX_LENGTH = 4096


def _cache_kwarg(model: Any) -> str:
    """Name of the forward's KV-cache keyword: "cache" (newer transformers 5.x) or "past_key_values"."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    if "cache" in params:
        return "cache"
    return "past_key_values"


def new_dynamic_cache(config: Any) -> Any:
    """An empty DynamicCache; passing the config (5.x) lets transformers pick each layer's kind.
    Sliding-window layers keep only the window and cannot be rolled back past it: those get full-length
    layers instead (the attention mask still applies the window, from the config)."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=config)
    except TypeError:
        return DynamicCache()
    if any("Sliding" in type(layer).__name__ for layer in getattr(cache, "layers", ())):
        return DynamicCache()
    return cache


def _slice_layers(cache: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Apply fn to each layer's key/value tensors [B, heads, T, D] (either cache layout); False if unknown."""
    if hasattr(cache, "layers"):  # transformers >= 4.56: a list of layer objects
        for layer in cache.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            layer.keys, layer.values = fn(layer.keys), fn(layer.values)
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = layer.keys.shape[-2]
        return True
    if hasattr(cache, "key_cache"):  # older: parallel lists of tensors
        cache.key_cache = [fn(k) if k.numel() else k for k in cache.key_cache]
        cache.value_cache = [fn(v) if v.numel() else v for v in cache.value_cache]
        return True
    return False


def crop_cache(cache: Any, length: int) -> None:
    """Truncate a DynamicCache to its first `length` tokens, whatever `crop` convention transformers uses."""
    current = cache.get_seq_length()
    if length >= current:
        return
    for arg in (length - current, length):  # negative count (both conventions), then absolute length (4.x)
        try:
            cache.crop(arg)
        except (ValueError, TypeError, AttributeError):
            continue
        if cache.get_seq_length() == length:
            return
    sliced = _slice_layers(cache, lambda t: t[..., :length, :].contiguous())
    if not sliced or cache.get_seq_length() != length:
        raise RuntimeError(f"cannot crop the transformers cache to {length} tokens")


def default_max_length(config: Any, max_length: Optional[int] = None) -> int:
    """The KV cache length: max_length, else the model's position limit capped at DEFAULT_MAX_LENGTH."""
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(max_length or min(limit or DEFAULT_MAX_LENGTH, DEFAULT_MAX_LENGTH))


def _read_raw_config(path: Path) -> dict:
    cfg_path = path / "config.json"
    try:
        data = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise SpecplayError(f"{cfg_path}: cannot read config.json ({exc})") from None
    if not isinstance(data, dict):
        raise SpecplayError(f"{cfg_path}: config.json is not a JSON object")
    return data


def validated_config(path: Path, device: torch.device, dtype: torch.dtype, max_length: Optional[int]) -> Any:
    """The transformers config of a model folder, once its values, the shapes of a meta-device copy of the
    model, the safetensors headers and the memory estimate agree. SpecplayError naming the field and file."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg_path = path / "config.json"
    raw = _read_raw_config(path)
    validate.check_config_values(raw, cfg_path)
    validate.check_model_type(raw, cfg_path, CONFIG_MAPPING.keys())
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except Exception as exc:  # strict-config errors, unsupported architectures, bad values: all the config's
        raise SpecplayError(f"{cfg_path}: transformers cannot build the model it describes "
                            f"({type(exc).__name__}: {validate.one_line(exc)})") from None
    header = validate.read_checkpoint_header(path)
    shapes = {name: tuple(t.shape) for name, t in meta.state_dict().items()}
    validate.check_against_header(shapes, header, getattr(meta, "base_model_prefix", ""), cfg_path)
    length = default_max_length(config, max_length)
    numel = sum(p.numel() for p in meta.parameters())  # tied parameters count once
    validate.check_memory(validate.generic_memory(numel, header, config, dtype, length), device, path, length)
    return config


def check_loading_info(info: Any, path: Path) -> None:
    """Weights the checkpoint lacks are started from random values by transformers: refuse them."""
    missing = sorted((info or {}).get("missing_keys") or [])
    if missing:
        raise SpecplayError(f"{path}: {len(missing)} weight(s) missing from the checkpoint (e.g. "
                            f"{missing[0]}); transformers would start them from random values")


class HFRunner(CausalRunner):
    """A transformers `AutoModelForCausalLM` with a DynamicCache. Chains only."""

    supports_tree = False
    forward_path = "transformers path"

    def __init__(self, model: Any, *, max_length: Optional[int] = None):
        self.model = model.eval()
        cfg = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        out = model.get_output_embeddings()
        self.vocab_size = int(out.weight.shape[0]) if out is not None else int(cfg.vocab_size)
        self.hidden_size = int(model.get_input_embeddings().weight.shape[1])  # [V, H] table
        self.max_length = default_max_length(cfg, max_length)
        self._kwarg = _cache_kwarg(model)
        self.cache = new_dynamic_cache(cfg)
        self._length = 0

    @classmethod
    def from_pretrained(cls, path: Union[str, Path], device: Union[str, torch.device] = "cpu",
                        dtype: torch.dtype = torch.float32, max_length: Optional[int] = None) -> "HFRunner":
        """Load a local directory with transformers (local files only, never remote code, eager attention),
        validated first (`validated_config`)."""
        from transformers import AutoModelForCausalLM

        path = Path(path)
        validated_config(path, torch.device(device), dtype, max_length)
        kwargs = dict(local_files_only=True, trust_remote_code=False, attn_implementation="eager",
                      output_loading_info=True)
        try:
            model, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kwargs)
        except TypeError:  # releases before `dtype` replaced `torch_dtype`
            model, info = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=dtype, **kwargs)
        check_loading_info(info, path)
        if model.dtype != dtype:
            model = model.to(dtype)
        return cls(model.to(torch.device(device)), max_length=max_length)

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        self.cache = new_dynamic_cache(self.model.config)
        self._length = 0

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"rollback to {length}: cache holds {self._length} tokens")
        if length == 0:
            self.reset()
            return
        crop_cache(self.cache, length)
        self._length = length

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Gather rows start+keep into start.. (after a chain, the only case HFRunner meets, it is a crop)."""
        m = keep.numel()
        if start < 0 or start + m > self._length:
            raise ValueError(f"compact(start={start}, {m} rows) outside the cache of {self._length} tokens")
        rows = torch.cat([torch.arange(start), keep.cpu().long() + start])  # [start + m]
        if torch.equal(rows, torch.arange(start + m)):
            self.rollback(start + m)
            return

        def gather(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(-2, rows.to(t.device))

        if not _slice_layers(self.cache, gather):
            raise RuntimeError("cannot compact this transformers cache")
        self._length = start + m

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, parents: Optional[torch.Tensor] = None) -> ForwardOutput:
        if parents is not None:
            raise SpecplayError("tree drafting needs a Llama-family model (this one runs via transformers)")
        n = tokens.numel()
        if self._length + n > self.max_length:
            raise SpecplayError(
                f"context full: {self._length} cached + {n} new tokens exceed max_length {self.max_length}"
            )
        ids = fill_unknown(tokens.to(self.device), self.vocab_size, self.input_fill).reshape(1, n)  # [1, n]
        positions = torch.arange(self._length, self._length + n, device=self.device)[None]  # [1, n]
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            use_cache=True,
            output_hidden_states=True,
            **{self._kwarg: self.cache},
        )
        self._length += n
        if self.cache.get_seq_length() != self._length:
            held = self.cache.get_seq_length()
            raise RuntimeError(f"transformers cache holds {held} tokens, expected {self._length}")
        return ForwardOutput(out.logits[0].float(), out.hidden_states[-1][0])  # [n, V], [n, H]

    @torch.no_grad()
    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output embedding only: HF features are already normalised (see the module docstring)."""
        head = self.model.get_output_embeddings()
        return head(hidden.to(self.dtype)).float()  # [n, V]

    @torch.no_grad()
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings only (no position embeddings, e.g. GPT-2's wpe, are added)."""
        return self.model.get_input_embeddings()(tokens.to(self.device))  # [n, H]
