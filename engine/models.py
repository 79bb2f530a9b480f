"""Finding and loading the target/draft pair: local HF directories, cached Hub ids, or the shipped pair.

No network, ever: Hub ids are resolved through the local Hugging Face cache only, and remote code is never
run. Every user-fixable problem (missing path, corrupt files, mismatched tokenizers, no GPU) is a
`SpecplayError` naming the path or model.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Tuple, Union

import torch

from engine.errors import SpecplayError
from engine.runner import CausalRunner

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_DIR = REPO_ROOT / "assets" / "models"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


# ------------------------------------------------------------------------------------------------------------
# Device and dtype


def resolve_device(device: Union[str, torch.device] = "auto") -> torch.device:
    """"auto" -> cuda when usable else cpu; "cpu"; "cuda" / "cuda:N" (SpecplayError when no GPU is usable)."""
    if isinstance(device, torch.device):
        device = str(device)
    name = (device or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise SpecplayError(
                f"--device {name}: no usable CUDA GPU (torch {torch.__version__} sees none); use --device cpu"
            )
        dev = torch.device(name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise SpecplayError(f"--device {name}: only {torch.cuda.device_count()} CUDA GPU(s) visible")
        return dev
    raise SpecplayError(f"--device {device!r}: expected auto, cpu or cuda[:N]")


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_dtype(dtype: Union[None, str, torch.dtype], device: torch.device) -> torch.dtype:
    """None -> float32 on CPU, bfloat16 on CUDA; else a torch dtype or a name (bf16, fp16, float32...)."""
    if dtype is None:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise SpecplayError(f"--dtype {dtype!r}: expected one of {sorted(_DTYPES)}") from None


# ------------------------------------------------------------------------------------------------------------
# Paths


def _looks_like_path(name: str) -> bool:
    """True for names that cannot be Hub ids ("org/name" or "name"): those are local paths."""
    return name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1 or not _HUB_ID.match(name)


def resolve_model_dir(path_or_id: Union[str, Path]) -> Path:
    """A local model directory (must hold config.json), or a Hub id found in the local HF cache."""
    name = str(path_or_id)
    path = Path(name).expanduser()
    if path.exists() or _looks_like_path(name):
        if not path.is_dir():
            raise SpecplayError(f"{name}: no such model directory")
        if not (path / "config.json").is_file():
            raise SpecplayError(f"{name}: no config.json (not a Hugging Face model directory)")
        return path
    return _from_hf_cache(name)


def _from_hf_cache(repo_id: str) -> Path:
    """The cached snapshot of a Hub model; never downloads."""
    try:
        from huggingface_hub import snapshot_download

        snapshot = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # LocalEntryNotFoundError, OfflineModeIsEnabled, validation errors...
        if "Incomplete" in type(exc).__name__:
            raise SpecplayError(f"{repo_id}: its Hugging Face cache copy is incomplete ({exc})") from None
        raise SpecplayError(
            f"{repo_id}: not a local directory and not in the Hugging Face cache "
            f"({_hf_cache_dir()}); specplay never downloads, so fetch it first "
            f"(e.g. `hf download {repo_id}`) or name a local directory ({type(exc).__name__})"
        ) from None
    if not (snapshot / "config.json").is_file():
        raise SpecplayError(f"{repo_id}: the cached snapshot {snapshot} has no config.json")
    return snapshot


def _hf_cache_dir() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except Exception:  # pragma: no cover - very old huggingface_hub
        return os.environ.get("HF_HOME", "~/.cache/huggingface")


def shipped_pair() -> Tuple[Path, Path]:
    """(target_dir, draft_dir) of the pair shipped under assets/models."""
    target, draft = SHIPPED_DIR / "target", SHIPPED_DIR / "draft"
    if not ((target / "config.json").is_file() and (draft / "config.json").is_file()):
        raise SpecplayError(
            "No shipped models in assets/models yet; name a pair with --target DIR --draft DIR "
            "(local Hugging Face directories or cached Hub ids)"
        )
    return target, draft


# ------------------------------------------------------------------------------------------------------------
# Runners and tokenizers


def _read_config(model_dir: Path, name: str) -> dict:
    cfg = model_dir / "config.json"
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecplayError(f"{name}: corrupt config.json at {cfg} ({exc})") from None
    if not isinstance(data, dict):
        raise SpecplayError(f"{name}: corrupt config.json at {cfg} (not a JSON object)")
    return data


def load_runner(
    path_or_id: Union[str, Path],
    device: Union[str, torch.device] = "cpu",
    dtype: Union[None, str, torch.dtype] = None,
    max_length: Optional[int] = None,
) -> CausalRunner:
    """Load a causal LM: Llama / Qwen2 / Mistral -> `LlamaRunner` (trees), others -> `HFRunner` (chains).

    A Llama-family config using a feature the compact forward lacks (e.g. another rope type) also goes to
    HFRunner. dtype None means float32 on CPU and bfloat16 on CUDA."""
    from engine.llama import LlamaRunner, UnsupportedLlamaConfig, is_llama_family

    name = str(path_or_id)
    model_dir = resolve_model_dir(path_or_id)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    config = _read_config(model_dir, name)
    if is_llama_family(config):
        try:
            return _wrap_load(lambda: LlamaRunner.from_pretrained(model_dir, dev, dt, max_length), name)
        except UnsupportedLlamaConfig:
            pass
    from engine.hf_runner import HFRunner

    return _wrap_load(lambda: HFRunner.from_pretrained(model_dir, dev, dt, max_length), name)


def _wrap_load(load, name: str) -> Any:
    """Run a loader, turning library errors about bad files into a SpecplayError that names the model."""
    try:
        return load()
    except SpecplayError as exc:
        from engine.llama import UnsupportedLlamaConfig

        if isinstance(exc, UnsupportedLlamaConfig) or name in str(exc):
            raise
        raise SpecplayError(f"{name}: {exc}") from None
    except (OSError, ValueError, KeyError, RuntimeError, TypeError, ImportError) as exc:
        raise SpecplayError(f"{name}: cannot load the model ({type(exc).__name__}: {exc})") from None
    except Exception as exc:  # safetensors' SafetensorError and other loader-specific errors
        if type(exc).__name__ in ("SafetensorError", "HeaderTooLarge", "EnvironmentError"):
            raise SpecplayError(f"{name}: corrupt weights ({exc})") from None
        raise


def load_tokenizer(path_or_id: Union[str, Path]) -> Any:
    """The model's tokenizer via AutoTokenizer, local files only, no remote code."""
    from transformers import AutoTokenizer

    name = str(path_or_id)
    model_dir = resolve_model_dir(path_or_id)
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises many kinds here (OSError, ValueError, tokenizers errors)
        raise SpecplayError(f"{name}: cannot load its tokenizer ({type(exc).__name__}: {exc})") from None


def check_same_vocab(target_tok: Any, draft_tok: Any, target_name: str, draft_name: str) -> None:
    """Speculative decoding compares token ids: both tokenizers must map the same strings to the same ids."""
    a, b = target_tok.get_vocab(), draft_tok.get_vocab()
    if a == b:
        return
    only_a = sorted(set(a) - set(b))[:3]
    differ = sorted(k for k in set(a) & set(b) if a[k] != b[k])[:3]
    detail = f"{len(a)} vs {len(b)} tokens"
    if only_a:
        detail += f"; e.g. {only_a} only in the target"
    if differ:
        detail += f"; e.g. {differ} have different ids"
    raise SpecplayError(
        f"target {target_name} and draft {draft_name} do not share a tokenizer ({detail}); "
        "pick a draft from the same model family"
    )


def common_vocab_size(target_vocab: int, draft_vocab: int, tokenizer_size: Optional[int] = None) -> int:
    """Logit width both models share: min of the two vocab sizes (the models' logit dims).

    Checkpoints often pad vocab_size (the embedding rows) beyond the tokenizer (e.g. to a multiple of 64); the
    padded rows are never real tokens. With the same tokenizer, ids below `len(tokenizer)` mean the same token
    in both models, so the engine slices both models' logits to `[..., :common]` before comparing p and q.
    SpecplayError when a model cannot score every token of the tokenizer."""
    common = min(int(target_vocab), int(draft_vocab))
    if tokenizer_size is not None and common < tokenizer_size:
        raise SpecplayError(
            f"model vocab sizes {target_vocab} / {draft_vocab} are smaller than "
            f"the tokenizer's {tokenizer_size}"
        )
    return common


@dataclass
class ModelPair:
    """What the decoder runs: a target, an optional draft (None for draft-free methods), one tokenizer."""

    target: CausalRunner
    draft: Optional[CausalRunner]
    tokenizer: Any
    target_name: str
    draft_name: Optional[str]
    vocab_size: int  # common logit width; slice logits to [..., :vocab_size]


def load_pair(
    target: Optional[Union[str, Path]],
    draft: Optional[Union[str, Path]],
    device: Union[str, torch.device] = "auto",
    need_draft: bool = True,
    dtype: Union[None, str, torch.dtype] = None,
    max_length: Optional[int] = None,
) -> ModelPair:
    """Load target (+ draft when need_draft). target None means the shipped pair (draft None then defaults to
    the shipped draft). The draft's tokenizer must match the target's."""
    if target is None:
        shipped_target, shipped_draft = shipped_pair()
        target = shipped_target
        draft = shipped_draft if draft is None else draft
    if need_draft and draft is None:
        raise SpecplayError(f"this method needs a draft model; name one with --draft DIR (target: {target})")
    dev = resolve_device(device)
    target_name = str(target)
    tokenizer = load_tokenizer(target)
    target_runner = load_runner(target, dev, dtype, max_length)
    tok_size = len(tokenizer)
    if not need_draft:
        vocab = common_vocab_size(target_runner.vocab_size, target_runner.vocab_size, tok_size)
        return ModelPair(target_runner, None, tokenizer, target_name, None, vocab)
    draft_name = str(draft)
    check_same_vocab(tokenizer, load_tokenizer(draft), target_name, draft_name)
    draft_runner = load_runner(draft, dev, dtype, max_length)  # type: ignore[arg-type]
    vocab = common_vocab_size(target_runner.vocab_size, draft_runner.vocab_size, tok_size)
    return ModelPair(target_runner, draft_runner, tokenizer, target_name, draft_name, vocab)
