"""CuPy raw-kernel backend: the functions of `kernels.reference` as CUDA kernels (`BACKEND`).

Importing this module without CuPy, or with CuPy but no usable CUDA device, raises ImportError, so that
`kernels.select_backend` falls back to the torch reference.

* Sources: `kernels/specplay_kernels.cu`, compiled once per process and device with `cupy.RawModule` (NVRTC,
  architecture of the current device, `--fmad=false` so that no multiply-add is contracted: the kernels must
  round like torch's separate ops).  `warm_up()` compiles every kernel up front and says so.
* Tensors: torch in, torch out.  The kernels take raw device pointers of the (validated, contiguous) torch tensors,
  which is the same zero-copy hand-over as DLPack without its per-tensor Python cost; they are launched on torch's
  current stream (`cupy.cuda.ExternalStream`).  No call synchronises with the host.
* NaN: the kernels set a flag in pinned host memory (no sync) and mark their outputs (-1 tokens / accepted, NaN
  probs).  The flag is checked at the start of every later call, which then raises ValueError, and by
  `check_nan()`, which synchronises the current stream first.  Set `EAGER_NAN_CHECK = True` to synchronise and
  raise inside every call instead (one host sync per call).
* Workspace (row statistics, a residual row per sequence, completion counters) is kept per (device, stream):
  calls on one stream are ordered; calls issued concurrently on one stream from several threads are not supported.
"""
from __future__ import annotations

import logging
import pathlib
import sys
import threading
import warnings
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch

from kernels.reference import VerifyResult

try:
    import cupy
except Exception as exc:  # ImportError, or a broken CUDA install raising at import
    raise ImportError(f"kernels.cuda needs CuPy: {exc}") from exc
try:
    _available = bool(cupy.is_available())
except Exception:  # pragma: no cover - driver problems
    _available = False
if not _available:
    raise ImportError("CuPy is installed but no CUDA device is available")

log = logging.getLogger(__name__)

BLOCK = 1024
MAX_V = 262144
MAX_N = 64
EAGER_NAN_CHECK = False
_SOURCE = pathlib.Path(__file__).with_name("specplay_kernels.cu")
_OPTIONS = ("--std=c++17", "--fmad=false", f"-DSP_BLOCK={BLOCK}")
_DTYPES = {torch.float32: "float", torch.bfloat16: "bf16_t", torch.float16: "f16_t"}
_TEMPLATES = [f"sp_sample<{t}>" for t in _DTYPES.values()] + [f"sp_verify<{t}>" for t in _DTYPES.values()]
_NAMES = _TEMPLATES + ["sp_sample_probs"]

_lock = threading.Lock()
_modules: dict = {}  # device index -> {name: RawKernel}
_streams: dict = {}  # stream pointer -> cupy ExternalStream
_work: dict = {}  # (device index, stream pointer) -> workspace
_parents_cache: dict = {}  # (device index, tuple of parents) -> device tensor
_nan_host = torch.zeros(1, dtype=torch.int32).pin_memory()  # written by the kernels through UVA
_nan_view = _nan_host.numpy()
_NAN_PTR = np.uint64(_nan_host.data_ptr())


def _kernels(device_index: int) -> dict:
    mods = _modules.get(device_index)
    if mods is not None:
        return mods
    with _lock:
        mods = _modules.get(device_index)
        if mods is None:
            msg = f"compiling CUDA kernels… ({_SOURCE.name}, device {device_index})"
            log.info(msg)
            print(msg, file=sys.stderr, flush=True)
            with cupy.cuda.Device(device_index):
                module = cupy.RawModule(code=_SOURCE.read_text(), options=_OPTIONS, name_expressions=_TEMPLATES)
                mods = {name: module.get_function(name) for name in _NAMES}
            _modules[device_index] = mods
    return mods


def warm_up(device=None) -> None:
    """Compile (or load from CuPy's cache) every kernel for `device` (default: torch's current CUDA device)."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    _kernels(dev.index if dev.index is not None else torch.cuda.current_device())


def check_nan(sync: bool = True) -> None:
    """Raise ValueError if a kernel has seen NaN logits since the last check (synchronises first if `sync`)."""
    if sync:
        torch.cuda.current_stream().synchronize()
    _raise_pending_nan()


def _raise_pending_nan() -> None:
    if _nan_view[0]:
        _nan_view[0] = 0
        raise ValueError("NaN in logits (seen by a CUDA sampling/verification kernel; outputs marked -1/NaN)")


def _stream(device_index: int):
    ptr = torch.cuda.current_stream(device_index).cuda_stream
    st = _streams.get(ptr)
    if st is None:
        with warnings.catch_warnings():  # deprecated in CuPy 14 in favour of Stream.from_external
            warnings.simplefilter("ignore", DeprecationWarning)
            st = cupy.cuda.ExternalStream(ptr, device_index)
        _streams[ptr] = st
    return ptr, st


def _workspace(device: torch.device, stream_ptr: int, rows: int, batch: int, vocab: int):
    key = (device.index, stream_ptr)
    ws = _work.get(key)
    if ws is None or ws["rows"] < rows or ws["batch"] < batch or ws["vocab_batch"] < batch * vocab:
        r = max(rows, ws["rows"] if ws else 0)
        b = max(batch, ws["batch"] if ws else 0)
        vb = max(batch * vocab, ws["vocab_batch"] if ws else 0)
        ws = {"rows": r, "batch": b, "vocab_batch": vb,
              "stats": torch.empty(r * 8, dtype=torch.int32, device=device),
              "counters": torch.zeros(b, dtype=torch.int32, device=device),
              "scratch": torch.empty(vb, dtype=torch.float32, device=device)}
        _work[key] = ws
    return ws


def _ptr(t: Optional[torch.Tensor]) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _check_logits(logits: torch.Tensor, name: str = "logits") -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or logits.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor")
    if logits.dtype not in _DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.shape[-1] < 1 or logits.shape[-1] > MAX_V:
        raise ValueError(f"{name}: vocabulary size {logits.shape[-1]} outside 1..{MAX_V}")
    return logits if logits.is_contiguous() else logits.contiguous()


def _check_f32(t: torch.Tensor, shape: tuple, device: torch.device, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {getattr(t, 'shape', None)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if t.dtype != torch.float32:
        t = t.float()
    return t if t.is_contiguous() else t.contiguous()


def _check_long(t: torch.Tensor, shape: tuple, device: torch.device, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {getattr(t, 'shape', None)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if t.dtype != torch.int64:
        t = t.long()
    return t if t.is_contiguous() else t.contiguous()


def _warp_cfg(temperature: float, top_k: int, top_p: float, vocab: int):
    temperature = float(temperature)
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    top_p = float(top_p)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    greedy = temperature == 0.0
    # torch multiplies CUDA tensors by the fp32 reciprocal of a Python-scalar divisor
    inv_t = np.float32(1.0) if greedy else np.float32(1.0) / np.float32(temperature)
    k = int(top_k)
    use_k = 0 < k < vocab and not greedy
    use_p = top_p < 1.0 and not greedy
    tp_fixed = int(float(np.float32(top_p)) * 2.0 ** 62) if use_p else 0
    return (np.float32(inv_t), np.int32(1 if greedy else 0), np.int32(k if use_k else 0),
            np.int32(1 if use_p else 0), np.uint64(tp_fixed))


def _launch(kernel, grid, args, device_index: int) -> None:
    _, st = _stream(device_index)
    with st:
        kernel(grid, (BLOCK,), args)


def _after_call() -> None:
    if EAGER_NAN_CHECK:
        check_nan(sync=True)


# ----------------------------------------------------------------------------------------------- sampling
def _sample_rows(logits: torch.Tensor, uniforms: Optional[torch.Tensor], temperature: float, top_k: int,
                 top_p: float, mode: int):
    _raise_pending_nan()
    logits = _check_logits(logits)
    dev = logits.device
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    rows = flat.shape[0]
    cfg = _warp_cfg(temperature, top_k, top_p, vocab)
    kern = _kernels(dev.index)[f"sp_sample<{_DTYPES[logits.dtype]}>"]
    if mode == 0:
        u = _check_f32(uniforms, (rows,), dev, "uniforms")
        tokens = torch.empty(rows, dtype=torch.long, device=dev)
        probs = torch.empty(rows, dtype=torch.float32, device=dev)
        out = None
    else:
        u = tokens = probs = None
        out = torch.empty(flat.shape, dtype=torch.float32, device=dev)
    if rows > 0:
        _launch(kern, (rows,), (_ptr(flat), np.int32(rows), np.int32(vocab), _ptr(u), *cfg, np.int32(mode),
                                _ptr(tokens), _ptr(probs), _ptr(out), _NAN_PTR), dev.index)
    _after_call()
    if mode == 0:
        return tokens, probs
    return out.reshape(logits.shape)


def warp_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution of logits [..., V] -> probs [..., V] float32 (see reference.warp_probs)."""
    return _sample_rows(logits, None, temperature, top_k, top_p, mode=1)


def sample(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_k: int = 0,
           top_p: float = 1.0):
    """logits [R, V], uniforms [R] -> (tokens [R] int64, token_probs [R] float32) (see reference.sample)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [R, V], got {tuple(logits.shape)}")
    return _sample_rows(logits, uniforms, temperature, top_k, top_p, mode=0)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling in token-id order: probs [R, V], uniforms [R] -> tokens [R] int64."""
    _raise_pending_nan()
    if not isinstance(probs, torch.Tensor) or probs.device.type != "cuda" or probs.dim() != 2:
        raise ValueError("probs must be a CUDA tensor [R, V]")
    rows, vocab = probs.shape
    if vocab < 1 or vocab > MAX_V:
        raise ValueError(f"probs: vocabulary size {vocab} outside 1..{MAX_V}")
    dev = probs.device
    probs = _check_f32(probs, (rows, vocab), dev, "probs")
    u = _check_f32(uniforms, (rows,), dev, "uniforms")
    tokens = torch.empty(rows, dtype=torch.long, device=dev)
    if rows > 0:
        kern = _kernels(dev.index)["sp_sample_probs"]
        _launch(kern, (rows,), (_ptr(probs), np.int32(rows), np.int32(vocab), _ptr(u), _ptr(tokens)), dev.index)
    return tokens


# ----------------------------------------------------------------------------------------------- verification
def _device_parents(parents: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    if not isinstance(parents, torch.Tensor) or tuple(parents.shape) != (n,):
        raise ValueError(f"parents must have shape ({n},)")
    if parents.device.type == "cuda":  # used as given (validating it would need a host sync)
        if parents.device != device:
            raise ValueError(f"parents must be on {device} or the CPU")
        return parents if parents.dtype == torch.int64 and parents.is_contiguous() else parents.long().contiguous()
    plist = tuple(int(p) for p in parents.tolist())
    key = (device.index, plist)
    t = _parents_cache.get(key)
    if t is None:
        for i, p in enumerate(plist):
            if not -1 <= p < i:
                raise ValueError(f"parents must be topologically ordered (-1 <= parents[i] < i); parents[{i}] = {p}")
        t = torch.tensor(plist, dtype=torch.int64, device=device)
        _parents_cache[key] = t
    return t


def _chain_parents(n: int, device: torch.device) -> torch.Tensor:
    key = (device.index, "chain", n)
    t = _parents_cache.get(key)
    if t is None:
        t = torch.arange(-1, n - 1, dtype=torch.int64, device=device)
        _parents_cache[key] = t
    return t


def _verify(target_logits, draft_tokens, parents, draft_probs, uniforms, temperature, top_k, top_p,
            greedy_verify: bool, chain: bool) -> VerifyResult:
    _raise_pending_nan()
    logits = _check_logits(target_logits, "target_logits")
    dev = logits.device
    if logits.dim() != 3:
        raise ValueError(f"target_logits must be [B, N+1, V], got {tuple(logits.shape)}")
    batch, n1, vocab = logits.shape
    n = n1 - 1
    if not 1 <= n <= MAX_N:
        raise ValueError(f"number of drafted nodes must be in 1..{MAX_N}, got {n}")
    draft = _check_long(draft_tokens, (batch, n), dev, "draft_tokens")
    par = _chain_parents(n, dev) if chain else _device_parents(parents, n, dev)
    if greedy_verify:
        cfg = (np.float32(1.0), np.int32(0), np.int32(0), np.int32(0), np.uint64(0))
        q = u = None
    else:
        cfg = _warp_cfg(temperature, top_k, top_p, vocab)
        q = None if draft_probs is None else _check_f32(draft_probs, (batch, n, vocab), dev, "draft_probs")
        u = _check_f32(uniforms, (batch, n1), dev, "uniforms")
    ints = torch.empty(batch, 2 + n, dtype=torch.long, device=dev)
    floats = torch.empty(3, batch, n, dtype=torch.float32, device=dev)
    tested = torch.empty(batch, n, dtype=torch.bool, device=dev)
    if batch > 0:
        ptr, _ = _stream(dev.index)
        ws = _workspace(dev, ptr, batch * n1, batch, vocab)
        kern = _kernels(dev.index)[f"sp_verify<{_DTYPES[logits.dtype]}>"]
        _launch(kern, (n1, batch), (
            _ptr(logits), np.int32(batch), np.int32(n), np.int32(vocab), _ptr(draft), _ptr(par), _ptr(q), _ptr(u),
            *cfg, np.int32(1 if greedy_verify else 0), _ptr(ws["stats"]), _ptr(ws["counters"]),
            _ptr(ws["scratch"]), _ptr(ints), _ptr(floats), _ptr(tested), _NAN_PTR), dev.index)
    _after_call()
    return VerifyResult(accepted=ints[:, 0], next_token=ints[:, 1], path=ints[:, 2:], p_draft=floats[0],
                        q_draft=floats[1], accept_prob=floats[2], tested=tested)


def verify_tree_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                       parents: torch.Tensor) -> VerifyResult:
    """Greedy tree verification (see reference.verify_tree_greedy)."""
    return _verify(target_logits, draft_tokens, parents, None, None, 1.0, 0, 1.0, greedy_verify=True, chain=False)


def verify_tree_stochastic(target_logits: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor,
                           draft_probs: Optional[torch.Tensor], uniforms: torch.Tensor, temperature: float,
                           top_k: int = 0, top_p: float = 1.0) -> VerifyResult:
    """Recursive rejection sampling over a token tree (see reference.verify_tree_stochastic)."""
    return _verify(target_logits, draft_tokens, parents, draft_probs, uniforms, temperature, top_k, top_p,
                   greedy_verify=False, chain=False)


def verify_chain_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> VerifyResult:
    """Greedy chain verification (see reference.verify_chain_greedy)."""
    return _verify(target_logits, draft_tokens, None, None, None, 1.0, 0, 1.0, greedy_verify=True, chain=True)


def verify_chain_stochastic(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                            draft_probs: Optional[torch.Tensor], uniforms: torch.Tensor, temperature: float,
                            top_k: int = 0, top_p: float = 1.0) -> VerifyResult:
    """Standard speculative sampling over a chain (see reference.verify_chain_stochastic)."""
    return _verify(target_logits, draft_tokens, None, draft_probs, uniforms, temperature, top_k, top_p,
                   greedy_verify=False, chain=True)


BACKEND = SimpleNamespace(
    name="cupy-raw-kernels", warp_probs=warp_probs, sample_from_probs=sample_from_probs, sample=sample,
    verify_chain_greedy=verify_chain_greedy, verify_chain_stochastic=verify_chain_stochastic,
    verify_tree_greedy=verify_tree_greedy, verify_tree_stochastic=verify_tree_stochastic,
    warm_up=warm_up, check_nan=check_nan)
