"""Finding and loading the target/draft pair: local HF directories, cached Hub ids, or the shipped pair.

No network, ever: Hub ids are resolved through the local Hugging Face cache only, and remote code is never
run. Every user-fixable problem (missing path, corrupt files, mismatched tokenizers, no GPU) is a
`SpecplayError` naming the path or model, in one line: what the libraries print while loading (log records,
warnings, progress bars) is captured, and a failure's first captured line is folded into the error.

Folders are validated before anything large is allocated (engine.models.validate, through the runners'
from_pretrained). The pair's logit width is the target's: a draft with a narrower vocabulary proposes from
its own ids (its logits are padded with -inf, q = 0 elsewhere), so the target's distribution stays whole.
"""
from __future__ import annotations

import io
import logging
import os
import pickle
import re
import warnings
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple, Union

import torch

from engine.errors import SpecplayError
from engine.models import validate
from engine.models.runner import CausalRunner

REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED_DIR = REPO_ROOT / "assets" / "models"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# Files a tokenizer may be built from when tokenizer.json is missing (named in the error)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
                   "spiece.model", "special_tokens_map.json")
CHATTY_LOGGERS = ("transformers", "huggingface_hub", "safetensors", "tokenizers")


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


class _Collect(logging.Handler):
    def __init__(self, lines: List[str]):
        super().__init__(logging.WARNING)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())



@contextmanager
def captured_chatter() -> Iterator[List[str]]:
    """Hold back what the libraries print while a model loads: log records of CHATTY_LOGGERS, Python
    warnings, and whatever goes to stdout/stderr (transformers' progress bars and load report). Yields the
    list that receives the captured lines, non-empty ones only. stdout/stderr are process-wide: another
    thread's prints during a load are held back too."""
    lines: List[str] = []
    handler = _Collect(lines)
    saved = []
    for name in CHATTY_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.handlers[:], logger.propagate))
        logger.handlers, logger.propagate = [handler], False
    out = io.StringIO()
    try:
        with warnings.catch_warnings(record=True) as caught, redirect_stdout(out), redirect_stderr(out):
            warnings.simplefilter("always")
            try:
                yield lines
            finally:
                lines.extend(str(w.message) for w in caught)
    finally:
        for logger, handlers, propagate in saved:
            logger.handlers, logger.propagate = handlers, propagate
        lines.extend(line.strip() for line in out.getvalue().replace("\r", "\n").splitlines())
        lines[:] = [line for line in lines if line.strip()]


def _first_chatter(lines: List[str]) -> str:
    """The first captured line worth quoting (progress bars are not), shortened."""
    for line in lines:
        text = re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
        if text and "it/s]" not in text and "%|" not in text:
            return text if len(text) <= 160 else text[:159] + "…"
    return ""


def _read_config(model_dir: Path, name: str) -> dict:
    from engine.models.llama import read_config_json

    return read_config_json(model_dir, name)


def load_runner(
    path_or_id: Union[str, Path],
    device: Union[str, torch.device] = "cpu",
    dtype: Union[None, str, torch.dtype] = None,
    max_length: Optional[int] = None,
) -> CausalRunner:
    """Load a causal LM: Llama / Qwen2 / Qwen3 / Mistral -> `LlamaRunner` (trees, CUDA graphs, the fused
    step), others -> `HFRunner` (chains).

    A Llama-family config using a feature the compact forward lacks (e.g. another rope type) also goes to
    HFRunner. The runner's forward_path says which path runs and, off the fast path, why (see
    off_fast_path). dtype None means float32 on CPU and bfloat16 on CUDA."""
    from engine.models.llama import LlamaRunner, UnsupportedLlamaConfig, is_llama_family

    name = str(path_or_id)
    model_dir = resolve_model_dir(path_or_id)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    config = _read_config(model_dir, name)
    reason = off_fast_path(config)
    if is_llama_family(config):
        try:
            return _wrap_load(lambda: LlamaRunner.from_pretrained(model_dir, dev, dt, max_length), name)
        except UnsupportedLlamaConfig as exc:
            reason = str(exc)
    from engine.models.hf_runner import HFRunner

    runner = _wrap_load(lambda: HFRunner.from_pretrained(model_dir, dev, dt, max_length), name)
    runner.forward_path = f"transformers path: {reason}"
    return runner


def off_fast_path(config: dict) -> str:
    """Why a config.json's model is not on the fast path (LlamaRunner), judged from its model_type alone;
    "" for the families it runs (a feature it lacks is found when the spec is read)."""
    from engine.models.llama import LLAMA_FAMILY, is_llama_family

    if is_llama_family(config):
        return ""
    families = ", ".join(sorted(LLAMA_FAMILY))
    return f"model_type {config.get('model_type')!r} is not on the fast path ({families} are)"


def forward_paths(target: CausalRunner, draft: Optional[CausalRunner] = None) -> str:
    """Which forward runs each loaded model, and why where it is not the fast path, in one line:
    "target: fast path; draft: transformers path: model_type 'gpt2' is not on the fast path (…)"."""
    parts = [f"target: {target.forward_path}"]
    if draft is not None:
        parts.append(f"draft: {draft.forward_path}")
    return "; ".join(parts)


def _wrap_load(load, name: str) -> Any:
    """Run a loader with the libraries' chatter captured, turning library errors about bad files into one
    SpecplayError line that names the model."""
    from engine.models.llama import UnsupportedLlamaConfig

    chatter: List[str] = []
    try:
        with captured_chatter() as chatter:
            return load()
    except UnsupportedLlamaConfig:
        raise
    except SpecplayError as exc:
        raise SpecplayError(str(exc) if name in str(exc) else f"{name}: {exc}") from None
    except pickle.UnpicklingError:
        raise SpecplayError(_pickle_message(name)) from None
    except Exception as exc:  # transformers, torch and safetensors raise many kinds for bad files
        if "weights_only" in str(exc):
            raise SpecplayError(_pickle_message(name)) from None
        if type(exc).__name__ in ("SafetensorError", "HeaderTooLarge"):
            raise SpecplayError(f"{name}: corrupt weights ({validate.one_line(exc)})") from None
        if not isinstance(exc, (OSError, ValueError, KeyError, RuntimeError, TypeError, ImportError)):
            raise
        said = _first_chatter(chatter)
        raise SpecplayError(f"{name}: cannot load the model ({type(exc).__name__}: {validate.one_line(exc)})"
                            + (f"; transformers said: {said}" if said else "")) from None


def _pickle_message(name: str) -> str:
    """torch refused a pickle checkpoint under weights_only; its advice (turn that off) is not relayed."""
    return (f"{name}: its pickle checkpoint (pytorch_model.bin) holds more than tensors, so it cannot be "
            "loaded safely; specplay never runs code from a model file: use a safetensors checkpoint")


def load_tokenizer(path_or_id: Union[str, Path]) -> Any:
    """The model's tokenizer via AutoTokenizer, local files only, no remote code."""
    from transformers import AutoTokenizer

    name = str(path_or_id)
    model_dir = resolve_model_dir(path_or_id)
    try:
        with captured_chatter():
            return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True,
                                                 trust_remote_code=False)
    except Exception as exc:  # transformers raises many kinds here (OSError, ValueError, tokenizers errors)
        config_problem = _config_problem(model_dir)
        if config_problem:
            raise SpecplayError(f"{name}: {config_problem}") from None
        if (model_dir / "tokenizer.json").is_file():
            detail = f"({type(exc).__name__}: {validate.one_line(exc, 200)})"
        else:
            others = [f for f in TOKENIZER_FILES if (model_dir / f).is_file()]
            detail = ("(no tokenizer.json, and transformers cannot build one from " + ", ".join(others) + ")"
                      if others else "(no tokenizer.json nor any other tokenizer file)")
        raise SpecplayError(f"{name}: cannot load its tokenizer {detail}") from None



def _config_problem(model_dir: Path) -> Optional[str]:
    """Why transformers cannot read the folder's config.json (AutoTokenizer reads it too), or None."""
    from transformers import AutoConfig

    try:
        with captured_chatter():
            AutoConfig.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # any failure here is the config's, not the tokenizer's
        return f"transformers cannot read config.json ({type(exc).__name__}: {validate.one_line(exc, 200)})"
    return None


def check_same_vocab(target_tok: Any, draft_tok: Any, target_name: str, draft_name: str,
                     width: Optional[int] = None) -> None:
    """Speculative decoding passes token ids between the models, so an id must stand for the same token in
    both tokenizers. Compared: every id of either tokenizer's base vocabulary (a draft whose tokenizer lacks
    some of the target's tokens belongs to another family), and the added tokens both tokenizers define
    below `width`, the narrower model's logit width (the ids both models can emit). An added token only one
    tokenizer has is skipped: tokenizer classes add different defaults (the Qwen2 class adds <|endoftext|>
    past the vocabulary; Llama's does not)."""
    a, b = target_tok.get_vocab(), draft_tok.get_vocab()
    if a == b:
        return
    by_id_a, by_id_b = {i: t for t, i in a.items()}, {i: t for t, i in b.items()}
    base = (by_id_a.keys() - _added_ids(target_tok)) | (by_id_b.keys() - _added_ids(draft_tok))
    added = {i for i in by_id_a.keys() & by_id_b.keys() if width is None or i < width}
    compared = base | added
    differ = sorted(i for i in compared if by_id_a.get(i) != by_id_b.get(i))
    if not differ:
        return
    examples = ", ".join(f"id {i}: {by_id_a.get(i)!r} vs {by_id_b.get(i)!r}" for i in differ[:3])
    raise SpecplayError(
        f"target {target_name} and draft {draft_name} do not share a tokenizer ({len(differ)} of "
        f"{len(compared)} ids differ, e.g. {examples}); pick a draft from the same model family"
    )


def _added_ids(tokenizer: Any) -> set:
    """Ids of the tokens added on top of the tokenizer's base vocabulary (specials included)."""
    return set(getattr(tokenizer, "added_tokens_decoder", None) or {})


def check_tokenizer_fits(tokenizer: Any, model_vocab: int, name: str) -> None:
    """The target must score every token of its tokenizer's base vocabulary. Added tokens past the model's
    vocabulary are allowed, as transformers allows them (the Qwen2 tokenizer adds <|endoftext|>); padded
    rows past the tokenizer (vocab_size rounded up to a multiple of 64) are kept: they are part of the
    target's distribution."""
    base = int(getattr(tokenizer, "vocab_size", None) or len(tokenizer))
    if model_vocab < base:
        raise SpecplayError(f"{name}: the model scores {model_vocab} tokens but its tokenizer has {base}")


def _config_vocab(model_dir: Path, name: str) -> Optional[int]:
    value = _read_config(model_dir, name).get("vocab_size")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_model_config(path_or_id: Union[str, Path]) -> None:
    """config.json problems reported as such, before the tokenizer (which reads config.json too) is loaded:
    the cheap checks of the runner that will load the folder."""
    from engine.models.llama import UnsupportedLlamaConfig, is_llama_family, spec_from_config

    name = str(path_or_id)
    model_dir = resolve_model_dir(path_or_id)
    config = _read_config(model_dir, name)
    try:
        if is_llama_family(config):
            try:
                spec_from_config(model_dir, config)
                return
            except UnsupportedLlamaConfig:
                pass
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        validate.check_config_values(config, model_dir / "config.json")
        validate.check_model_type(config, model_dir / "config.json", CONFIG_MAPPING.keys())
    except SpecplayError as exc:
        raise SpecplayError(str(exc) if name in str(exc) else f"{name}: {exc}") from None


@dataclass
class ModelPair:
    """What the decoder runs: a target, an optional draft (None for draft-free methods), one tokenizer."""

    target: CausalRunner
    draft: Optional[CausalRunner]
    tokenizer: Any
    target_name: str
    draft_name: Optional[str]
    vocab_size: int  # the target's logit width: every distribution p and q is over these ids


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
    check_model_config(target)
    if need_draft:
        check_model_config(draft)  # type: ignore[arg-type]
    tokenizer = load_tokenizer(target)
    config_vocab = _config_vocab(resolve_model_dir(target), target_name)
    if config_vocab is not None:  # before the weights are read
        check_tokenizer_fits(tokenizer, config_vocab, target_name)
    target_runner = load_runner(target, dev, dtype, max_length)
    check_tokenizer_fits(tokenizer, target_runner.vocab_size, target_name)
    vocab = target_runner.vocab_size
    if not need_draft:
        return ModelPair(target_runner, None, tokenizer, target_name, None, vocab)
    draft_name = str(draft)
    # the draft's logit width from config.json: validation holds the checkpoint to it
    draft_width = _config_vocab(resolve_model_dir(draft), draft_name)  # type: ignore[arg-type]
    width = vocab if draft_width is None else min(vocab, draft_width)
    check_same_vocab(tokenizer, load_tokenizer(draft), target_name, draft_name, width)  # type: ignore[arg-type]
    draft_runner = load_runner(draft, dev, dtype, max_length)  # type: ignore[arg-type]
    if draft_runner.vocab_size < vocab:  # the draft reads the target's tokens: ids it lacks read as unknown
        unk = getattr(tokenizer, "unk_token_id", None)
        draft_runner.input_fill = unk if isinstance(unk, int) and 0 <= unk < draft_runner.vocab_size else 0
    return ModelPair(target_runner, draft_runner, tokenizer, target_name, draft_name, vocab)
