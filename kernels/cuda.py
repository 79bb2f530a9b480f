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
from typing import Optional

import numpy as np
import torch

from kernels.backend import ModuleBackend
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
_TEMPLATES = ([f"sp_sample<{t}>" for t in _DTYPES.values()] + [f"sp_verify<{t}>" for t in _DTYPES.values()]
              + [f"sp_wide<{t}>" for t in _DTYPES.values()])
_NAMES = _TEMPLATES + ["sp_sample_probs"]

_lock = threading.Lock()
_modules: dict = {}  # device index -> {name: RawKernel}
_streams: dict = {}  # stream pointer -> cupy ExternalStream
_work: dict = {}  # (device index, stream pointer) -> workspace
_parents_cache: dict = {}  # (device index, tuple of parents) -> device tensor
# Wide path (rows split over many blocks, one persistent launch): sampling and chain verification without
# top-k / top-p, for vocabularies of at least WIDE_MIN_V tokens (0 disables it).
WIDE_MIN_V = int(__import__("os").environ.get("SPECPLAY_WIDE_MIN_V", "4096"))
_TILE = BLOCK * 4
# kernel argument layouts for the direct driver launch: Q = pointer / uint64, i = int32, f = float32
_ARGS = {"sp_sample": "QiiQfiiiQiQQQQ", "sp_sample_probs": "QiiQQ",
         "sp_verify": "QiiiQQQQfiiiQiQQQQQQQ", "sp_wide": "QiiiQQQfiiQQQQQQQQ"}
_fast = {"on": True}  # cleared if the direct launch fails its self-check
_tls = threading.local()
_sms: dict = {}
_wide_ws: dict = {}  # (device index, stream pointer) -> (bytes, ws tensor, sync tensor, batch capacity)
_nan_host = torch.zeros(1, dtype=torch.int32).pin_memory()  # written by the kernels through UVA
_nan_view = _nan_host.numpy()
_NAN_INT = int(_nan_host.data_ptr())


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
            _sms[device_index] = torch.cuda.get_device_properties(device_index).multi_processor_count
            _self_check(device_index)
    return mods


class _Launcher:
    """Direct cuLaunchKernel with a preallocated, per-thread argument block (no per-argument Python work)."""

    def __init__(self, kernel, layout: str):
        import ctypes
        import struct
        self.kernel = kernel
        fn = getattr(kernel, "kernel", kernel)
        self.fn = int(fn.ptr)
        fmt, off, offs = "<", 0, []
        for ch in layout:
            size = 8 if ch == "Q" else 4
            pad = (-off) % size
            fmt += "x" * pad
            off += pad
            offs.append(off)
            fmt += ch
            off += size
        self.struct = struct.Struct(fmt)
        self.buf = ctypes.create_string_buffer(max(off, 8))
        base = ctypes.addressof(self.buf)
        self.params = (ctypes.c_void_p * len(offs))(*[base + o for o in offs])
        self.params_ptr = ctypes.addressof(self.params)
        self.conv = [np.uint64 if ch == "Q" else (np.int32 if ch == "i" else np.float32) for ch in layout]
        self.launch_driver = cupy.cuda.driver.launchKernel

    def __call__(self, grid, args, stream_ptr: int, device_index: int) -> None:
        if _fast["on"]:
            self.struct.pack_into(self.buf, 0, *args)
            try:
                self.launch_driver(self.fn, grid[0], grid[1], 1, BLOCK, 1, 1, 0, stream_ptr, self.params_ptr, 0)
                return
            except Exception:  # e.g. no current context in this thread: take CuPy's launch
                pass
        st = _cupy_stream(stream_ptr, device_index)
        with st:
            self.kernel(grid, (BLOCK,), tuple(cv(a) for cv, a in zip(self.conv, args)))


def _launcher(device_index: int, name: str) -> _Launcher:
    cache = getattr(_tls, "launchers", None)
    if cache is None:
        cache = _tls.launchers = {}
    key = (device_index, name)
    ln = cache.get(key)
    if ln is None:
        ln = cache[key] = _Launcher(_kernels(device_index)[name], _ARGS[name.split("<")[0]])
    return ln


try:
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - older torch
    def _raw_stream(device_index: int) -> int:
        return torch.cuda.current_stream(device_index).cuda_stream


def _cupy_stream(ptr: int, device_index: int):
    st = _streams.get(ptr)
    if st is None:
        with warnings.catch_warnings():  # deprecated in CuPy 14 in favour of Stream.from_external
            warnings.simplefilter("ignore", DeprecationWarning)
            st = cupy.cuda.ExternalStream(ptr, device_index)
        _streams[ptr] = st
    return st


def _self_check(device_index: int) -> None:
    """Run one small kernel through the direct launch and through CuPy's; keep the direct one if they agree."""
    try:
        dev = torch.device("cuda", device_index)
        with torch.cuda.device(dev):
            probs = torch.softmax(torch.arange(37, dtype=torch.float32, device=dev).reshape(1, 37).repeat(5, 1) * 0.1, -1)
            u = torch.tensor([0.01, 0.3, 0.5, 0.8, 0.999], dtype=torch.float32, device=dev)
            a = torch.full((5,), -7, dtype=torch.long, device=dev)
            bb = torch.full((5,), -7, dtype=torch.long, device=dev)
            ln = _Launcher(_modules[device_index]["sp_sample_probs"], _ARGS["sp_sample_probs"])
            sp = _raw_stream(device_index)
            ln.struct.pack_into(ln.buf, 0, probs.data_ptr(), 5, 37, u.data_ptr(), a.data_ptr())
            ln.launch_driver(ln.fn, 5, 1, 1, BLOCK, 1, 1, 0, sp, ln.params_ptr, 0)
            with _cupy_stream(sp, device_index):
                ln.kernel((5,), (BLOCK,), (np.uint64(probs.data_ptr()), np.int32(5), np.int32(37),
                                           np.uint64(u.data_ptr()), np.uint64(bb.data_ptr())))
            ok = bool(torch.equal(a, bb)) and int(a.min()) >= 0
    except Exception as exc:  # pragma: no cover - depends on the CuPy build
        log.warning("direct kernel launch unavailable (%s); using CuPy's launch", exc)
        ok = False
    if not ok:
        _fast["on"] = False


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


def _check_logits(logits: torch.Tensor, name: str = "logits") -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or not logits.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor")
    if logits.dtype not in _DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {logits.dtype}")
    v = logits.shape[-1] if logits.dim() else 0
    if v < 1 or v > MAX_V:
        raise ValueError(f"{name}: vocabulary size {v} outside 1..{MAX_V}")
    return logits if logits.is_contiguous() else logits.contiguous()


def _check_f32(t: torch.Tensor, shape: tuple, dev_index: int, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {getattr(t, 'shape', None)}")
    if t.get_device() != dev_index:
        raise ValueError(f"{name} must be on cuda:{dev_index}, got {t.device}")
    if t.dtype != torch.float32:
        t = t.float()
    return t if t.is_contiguous() else t.contiguous()


def _check_long(t: torch.Tensor, shape: tuple, dev_index: int, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {getattr(t, 'shape', None)}")
    if t.get_device() != dev_index:
        raise ValueError(f"{name} must be on cuda:{dev_index}, got {t.device}")
    if t.dtype != torch.int64:
        t = t.long()
    return t if t.is_contiguous() else t.contiguous()


_cfg_cache: dict = {}


def _warp_cfg(temperature: float, top_k: int, top_p: float, vocab: int):
    """(inv_t, greedy, top_k, use_topp, tp_fixed) as plain Python numbers (cached per setting)."""
    key = (temperature, top_k, top_p, vocab)
    cfg = _cfg_cache.get(key)
    if cfg is not None:
        return cfg
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
    cfg = (float(inv_t), 1 if greedy else 0, k if use_k else 0, 1 if use_p else 0, tp_fixed)
    if len(_cfg_cache) > 4096:
        _cfg_cache.clear()
    _cfg_cache[key] = cfg
    return cfg


def _after_call() -> None:
    if EAGER_NAN_CHECK:
        check_nan(sync=True)


def _wide_workspace(dev_index: int, stream_ptr: int, batch: int, n1: int, vocab: int, device):
    chunks = (vocab + _TILE - 1) // _TILE
    need = batch * n1 * chunks * 24 + batch * n1 * 32 + (batch + 1) * 16 + batch * chunks * 20 + 64
    key = (dev_index, stream_ptr)
    ent = _wide_ws.get(key)
    if ent is None or ent[0] < need or ent[3] < batch:
        nb = max(need, ent[0] if ent else 0)
        cap = max(batch, ent[3] if ent else 0)
        ws = torch.empty(nb, dtype=torch.uint8, device=device)
        sync = torch.zeros(cap + 2, dtype=torch.int32, device=device)
        ent = (nb, ws.data_ptr(), sync.data_ptr(), cap, ws, sync)
        _wide_ws[key] = ent
    return ent, chunks


def _grid_wide(dev_index: int, tasks: int) -> int:
    return max(1, min(_sms[dev_index], tasks))


# ----------------------------------------------------------------------------------------------- sampling
def _sample_rows(logits: torch.Tensor, uniforms: Optional[torch.Tensor], temperature: float, top_k: int,
                 top_p: float, mode: int):
    if _nan_view[0]:
        _raise_pending_nan()
    logits = _check_logits(logits)
    di = logits.get_device()
    dev = logits.device
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab) if logits.dim() != 2 else logits
    rows = flat.shape[0]
    cfg = _warp_cfg(temperature, top_k, top_p, vocab)
    tname = _DTYPES[logits.dtype]
    if mode == 0:
        u = _check_f32(uniforms, (rows,), di, "uniforms")
        tokens = torch.empty(rows, dtype=torch.long, device=dev)
        probs = torch.empty(rows, dtype=torch.float32, device=dev)
        if rows > 0:
            sp = _raw_stream(di)
            if WIDE_MIN_V and vocab >= WIDE_MIN_V and cfg[2] == 0 and cfg[3] == 0:
                ent, chunks = _wide_workspace(di, sp, rows, 1, vocab, dev)
                _launcher(di, f"sp_wide<{tname}>")((_grid_wide(di, rows * chunks), 1), (
                    flat.data_ptr(), rows, 0, vocab, 0, 0, u.data_ptr(), cfg[0], cfg[1], 0, ent[1], ent[2],
                    0, 0, 0, tokens.data_ptr(), probs.data_ptr(), _NAN_INT), sp, di)
            else:
                _launcher(di, f"sp_sample<{tname}>")((rows, 1), (
                    flat.data_ptr(), rows, vocab, u.data_ptr(), *cfg, 0, tokens.data_ptr(), probs.data_ptr(), 0,
                    _NAN_INT), sp, di)
        _after_call()
        return tokens, probs
    out = torch.empty(flat.shape, dtype=torch.float32, device=dev)
    if rows > 0:
        sp = _raw_stream(di)
        _launcher(di, f"sp_sample<{tname}>")((rows, 1), (
            flat.data_ptr(), rows, vocab, 0, *cfg, 1, 0, 0, out.data_ptr(), _NAN_INT), sp, di)
    _after_call()
    return out.reshape(logits.shape)


def warp_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution of logits [..., V] -> probs [..., V] float32 (see reference.warp_probs)."""
    return _sample_rows(logits, None, temperature, top_k, top_p, mode=1)


def sample(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_k: int = 0,
           top_p: float = 1.0):
    """logits [R, V], uniforms [R] -> (tokens [R] int64, token_probs [R] float32) (see reference.sample)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be [R, V], got {tuple(getattr(logits, 'shape', ()))}")
    return _sample_rows(logits, uniforms, temperature, top_k, top_p, mode=0)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling in token-id order: probs [R, V], uniforms [R] -> tokens [R] int64."""
    if _nan_view[0]:
        _raise_pending_nan()
    if not isinstance(probs, torch.Tensor) or not probs.is_cuda or probs.dim() != 2:
        raise ValueError("probs must be a CUDA tensor [R, V]")
    rows, vocab = probs.shape
    if vocab < 1 or vocab > MAX_V:
        raise ValueError(f"probs: vocabulary size {vocab} outside 1..{MAX_V}")
    di = probs.get_device()
    probs = _check_f32(probs, probs.shape, di, "probs")
    u = _check_f32(uniforms, (rows,), di, "uniforms")
    tokens = torch.empty(rows, dtype=torch.long, device=probs.device)
    if rows > 0:
        _launcher(di, "sp_sample_probs")((rows, 1), (probs.data_ptr(), rows, vocab, u.data_ptr(),
                                                     tokens.data_ptr()), _raw_stream(di), di)
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


_GREEDY_CFG = (1.0, 0, 0, 0, 0)


def _verify(target_logits, draft_tokens, parents, draft_probs, uniforms, temperature, top_k, top_p,
            greedy_verify: bool, chain: bool) -> VerifyResult:
    if _nan_view[0]:
        _raise_pending_nan()
    logits = _check_logits(target_logits, "target_logits")
    if logits.dim() != 3:
        raise ValueError(f"target_logits must be [B, N+1, V], got {tuple(logits.shape)}")
    di = logits.get_device()
    dev = logits.device
    batch, n1, vocab = logits.shape
    n = n1 - 1
    if n == 0:
        return _verify_nothing_drafted(logits, greedy_verify, uniforms, temperature, top_k, top_p)
    if not 1 <= n <= MAX_N:
        raise ValueError(f"number of drafted nodes must be in 1..{MAX_N}, got {n}")
    draft = _check_long(draft_tokens, (batch, n), di, "draft_tokens")
    if greedy_verify:
        cfg = _GREEDY_CFG
        q = u = None
    else:
        cfg = _warp_cfg(temperature, top_k, top_p, vocab)
        q = None if draft_probs is None else _check_f32(draft_probs, (batch, n, vocab), di, "draft_probs")
        u = _check_f32(uniforms, (batch, n1), di, "uniforms")
    ints = torch.empty(batch, 2 + n, dtype=torch.long, device=dev)
    floats = torch.empty(3, batch, n, dtype=torch.float32, device=dev)
    tested = torch.empty(batch, n, dtype=torch.bool, device=dev)
    wide = chain and WIDE_MIN_V and vocab >= WIDE_MIN_V and cfg[2] == 0 and cfg[3] == 0
    par = None if wide else (_chain_parents(n, dev) if chain else _device_parents(parents, n, dev))
    if batch > 0:
        sp = _raw_stream(di)
        qp = 0 if q is None else q.data_ptr()
        up = 0 if u is None else u.data_ptr()
        tname = _DTYPES[logits.dtype]
        if wide:
            ent, chunks = _wide_workspace(di, sp, batch, n1, vocab, dev)
            _launcher(di, f"sp_wide<{tname}>")((_grid_wide(di, batch * n1 * chunks), 1), (
                logits.data_ptr(), batch, n, vocab, draft.data_ptr(), qp, up, cfg[0], cfg[1],
                2 if greedy_verify else 1, ent[1], ent[2], ints.data_ptr(), floats.data_ptr(), tested.data_ptr(),
                0, 0, _NAN_INT), sp, di)
        else:
            ws = _workspace(dev, sp, batch * n1, batch, vocab)
            _launcher(di, f"sp_verify<{tname}>")((n1, batch), (
                logits.data_ptr(), batch, n, vocab, draft.data_ptr(), par.data_ptr(), qp, up, *cfg,
                1 if greedy_verify else 0, ws["stats"].data_ptr(), ws["counters"].data_ptr(),
                ws["scratch"].data_ptr(), ints.data_ptr(), floats.data_ptr(), tested.data_ptr(), _NAN_INT), sp, di)
    _after_call()
    return VerifyResult(accepted=ints[:, 0], next_token=ints[:, 1], path=ints[:, 2:], p_draft=floats[0],
                        q_draft=floats[1], accept_prob=floats[2], tested=tested)


def _verify_nothing_drafted(logits, greedy_verify, uniforms, temperature, top_k, top_p) -> VerifyResult:
    """An empty draft (plain decoding): the next token is the root row's argmax, or a sample from it."""
    batch, dev = logits.shape[0], logits.device
    if greedy_verify:
        token = logits[:, 0].argmax(-1)  # first index on ties, like the reference
    else:
        token, _ = sample(logits[:, 0].contiguous(), uniforms[:, 0].contiguous(), temperature, top_k, top_p)
    empty_f = torch.empty(batch, 0, dtype=torch.float32, device=dev)
    return VerifyResult(accepted=torch.zeros(batch, dtype=torch.long, device=dev), next_token=token.long(),
                        path=torch.empty(batch, 0, dtype=torch.long, device=dev), p_draft=empty_f, q_draft=empty_f,
                        accept_prob=empty_f, tested=torch.empty(batch, 0, dtype=torch.bool, device=dev))


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


class CudaBackend(ModuleBackend):
    """The CuPy raw kernels of this module as a `kernels.Backend`."""

    def __init__(self):
        super().__init__("cupy-raw-kernels", sys.modules[__name__], compiles_kernels=True,
                         flags_nan_on_device=True, warm_up=warm_up, check_nan=check_nan)


BACKEND = CudaBackend()
