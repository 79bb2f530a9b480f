"""CuPy raw-kernel backend: the functions of `engine.kernels.reference` as CUDA kernels (`BACKEND`).

Importing this module without CuPy, or with CuPy but no usable CUDA device, raises ImportError, so that
`engine.kernels.select_backend` falls back to the torch reference.

* Sources: `kernels/specplay_kernels.cu`, compiled once per process and device with `cupy.RawModule` (NVRTC,
  architecture of the current device, `--fmad=false` so that no multiply-add is contracted: the kernels must
  round like torch's separate ops).  `warm_up()` compiles every kernel up front and says so.
* Tensors: torch in, torch out.  The kernels take raw device pointers of the (validated, contiguous) torch
  tensors, which is the same zero-copy hand-over as DLPack without its per-tensor Python cost; they are
  launched on torch's current stream.  No call synchronises with the host.
* Launches name every kernel argument; `launch_spec` holds each kernel's parameter list (checked
  against the .cu by the CPU tests), the shared constants and the workspace sizes.
* NaN: the kernels set a flag in pinned host memory (no sync) and mark their outputs (-1 tokens / accepted,
  NaN probs).  The flag is checked at the start of every later call, which then raises ValueError, and by
  `check_nan()`, which synchronises the current stream first.  Set `EAGER_NAN_CHECK = True` to synchronise
  and raise inside every call instead (one host sync per call).
* Per-device state (kernels, launchers, workspaces, caches) lives in one `DeviceState` per device, from
  `_device(index)`.  Workspaces are kept per stream: calls on one stream are ordered; calls issued
  concurrently on one stream from several threads are not supported.
"""
from __future__ import annotations

import ctypes
import logging
import struct
import sys
import threading
import warnings
from collections import namedtuple
from typing import Mapping, Optional

import numpy as np
import torch

from engine.kernels.backend import ModuleBackend
from engine.kernels.launch_spec import (
    BLOCK,
    LOADS_AHEAD,
    MAX_N,
    MAX_V,
    NULL,
    READ_MAX_W,
    SOURCE,
    SPECS,
    WARP_ARGS,
    module_source,
    wide_chunks,
)
from engine.kernels.pdl import PdlLauncher
from engine.kernels.reference import VerifyResult
from engine.kernels.workspaces import Workspaces

try:
    import cupy
except Exception as exc:  # ImportError, or a broken CUDA install raising at import
    raise ImportError(f"engine.kernels.cuda needs CuPy: {exc}") from exc
try:
    _available = bool(cupy.is_available())
except Exception:  # pragma: no cover - driver problems
    _available = False
if not _available:
    raise ImportError("CuPy is installed but no CUDA device is available")

log = logging.getLogger(__name__)

EAGER_NAN_CHECK = False
_OPTIONS = ("--std=c++17", "--fmad=false", f"-DSP_BLOCK={BLOCK}", f"-DSP_LOADS_AHEAD={LOADS_AHEAD}")
_DTYPES = {torch.float32: "float", torch.bfloat16: "bf16_t", torch.float16: "f16_t"}
_TEMPLATES = [f"{spec.name}<{t}>" for spec in SPECS.values() if spec.templated for t in _DTYPES.values()]
_NAMES = _TEMPLATES + [spec.name for spec in SPECS.values() if not spec.templated]
_NUMPY_TYPES = {"Q": np.uint64, "i": np.int32, "f": np.float32}  # CuPy's own launch takes numpy scalars

# Wide path (rows split over many blocks, one persistent launch): sampling and chain verification without
# top-k / top-p, for vocabularies of at least WIDE_MIN_V tokens.
WIDE_MIN_V = 4096
# sp_sample's `mode`, sp_wide's `kind`
_MODE_SAMPLE, _MODE_WARP = 0, 1
_KIND_SAMPLE, _KIND_VERIFY_STOCHASTIC, _KIND_VERIFY_GREEDY = 0, 1, 2

_nan_host = torch.zeros(1, dtype=torch.int32).pin_memory()  # written by the kernels through UVA
_nan_view = _nan_host.numpy()
_NAN_INT = int(_nan_host.data_ptr())

try:
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - older torch
    def _raw_stream(device_index: int) -> int:
        return torch.cuda.current_stream(device_index).cuda_stream


# ----------------------------------------------------------------------------------------------- per device
class DeviceState:
    """Everything kept for one CUDA device: compiled kernels, launchers, workspaces and caches.

    Built by `_device(index)`, which compiles the kernels.  Workspaces are kept per stream pointer.
    """

    def __init__(self, index: int):
        self.index = index
        self.device = torch.device("cuda", index)
        self.streams: dict = {}  # stream pointer -> cupy ExternalStream (for CuPy's own launch)
        self.workspaces = Workspaces(self.device)  # the verification's and sp_wide's scratch, per stream
        self.parents: dict = {}  # tuple of parents, or ("chain", n) -> int64 device tensor
        self._threads = threading.local()  # .launchers: this thread's {kernel name: _Launcher}
        self.kernels = _compile(index)  # kernel name ("sp_wide<float>", ...) -> cupy RawKernel
        self.sms = torch.cuda.get_device_properties(index).multi_processor_count
        self.fast_launch = _self_check(self)  # direct cuLaunchKernel (else CuPy's launch)
        # programmatic launches (engine.kernels.pdl) for the calls made `chained`, behind a kernel of ours
        capability = torch.cuda.get_device_capability(index)
        self.pdl = PdlLauncher.load(capability) if self.fast_launch else None

    def launcher(self, name: str) -> _Launcher:
        """This thread's launcher of kernel `name` (each owns its argument block)."""
        cache = getattr(self._threads, "launchers", None)
        if cache is None:
            cache = self._threads.launchers = {}
        ln = cache.get(name)
        if ln is None:
            ln = cache[name] = _Launcher(self, name)
        return ln

    def cupy_stream(self, ptr: int):
        st = self.streams.get(ptr)
        if st is None:
            with warnings.catch_warnings():  # deprecated in CuPy 14 in favour of Stream.from_external
                warnings.simplefilter("ignore", DeprecationWarning)
                st = cupy.cuda.ExternalStream(ptr, self.index)
            self.streams[ptr] = st
        return st

    def verify_workspace(self, stream_ptr: int, rows: int, batch: int, vocab: int):
        return self.workspaces.verify(stream_ptr, rows, batch, vocab)

    def wide_workspace(self, stream_ptr: int, batch: int, rows_per_seq: int, chunks: int):
        return self.workspaces.wide(stream_ptr, batch, rows_per_seq, chunks)

    def wide_grid(self, tasks: int) -> int:
        """sp_wide's grid: at most one block per SM, so that all blocks are co-resident (grid barriers)."""
        return max(1, min(self.sms, tasks))


_lock = threading.Lock()
_devices: dict = {}  # device index -> DeviceState


def _device(index: int) -> DeviceState:
    """The state of CUDA device `index`, built (kernels compiled) on first use."""
    state = _devices.get(index)
    if state is not None:
        return state
    with _lock:
        state = _devices.get(index)
        if state is None:
            state = _devices[index] = DeviceState(index)
    return state


def _compile(index: int) -> dict:
    msg = f"compiling CUDA kernels… ({SOURCE.name}, device {index})"
    log.info(msg)
    print(msg, file=sys.stderr, flush=True)
    with cupy.cuda.Device(index):
        module = cupy.RawModule(code=module_source(), options=_OPTIONS, name_expressions=_TEMPLATES)
        return {name: module.get_function(name) for name in _NAMES}


# ----------------------------------------------------------------------------------------------- launching
class _Launcher:
    """Launches one kernel: direct cuLaunchKernel from a preallocated argument block (one `pack_into`, no
    per-argument Python work), or CuPy's launch when the direct one is off or raises."""

    def __init__(self, state: DeviceState, name: str):
        self.state = state
        self.kernel = state.kernels[name]
        self.spec = SPECS[name.split("<")[0]]
        self.fn = int(getattr(self.kernel, "kernel", self.kernel).ptr)
        fmt, offsets, size = self.spec.packing()
        self.struct = struct.Struct(fmt)
        self.buf = ctypes.create_string_buffer(max(size, 8))
        base = ctypes.addressof(self.buf)
        self.params = (ctypes.c_void_p * len(offsets))(*[base + o for o in offsets])
        self.params_ptr = ctypes.addressof(self.params)
        self.conv = [_NUMPY_TYPES[ch] for ch in self.spec.layout]
        self.launch_driver = cupy.cuda.driver.launchKernel

    def __call__(self, grid, stream_ptr: int, args: Mapping, chained: bool = False) -> None:
        """Launch on `grid` (x, y) blocks with `args` naming every kernel argument. chained: the stream's
        previous kernel is one of ours (a step kernel or one of these), so this launch may be programmatic
        (engine.kernels.pdl: it starts while that one finishes, and waits for it before reading anything)."""
        values = self.spec.values(args)
        if self.state.fast_launch:
            self.struct.pack_into(self.buf, 0, *values)
            pdl = self.state.pdl
            if chained and pdl is not None and pdl.launch_params(self.fn, grid, BLOCK, stream_ptr,
                                                                 self.params):
                return
            try:
                self.launch_packed(grid, stream_ptr)
                return
            except Exception:  # e.g. no current context in this thread: take CuPy's launch
                pass
        self.launch_cupy(grid, stream_ptr, values)

    def launch_packed(self, grid, stream_ptr: int) -> None:
        """cuLaunchKernel with the values last packed into the argument block."""
        self.launch_driver(self.fn, grid[0], grid[1], 1, BLOCK, 1, 1, 0, stream_ptr, self.params_ptr, 0)

    def launch_cupy(self, grid, stream_ptr: int, values: tuple) -> None:
        with self.state.cupy_stream(stream_ptr):
            self.kernel(grid, (BLOCK,), tuple(cv(v) for cv, v in zip(self.conv, values)))


def _launch(state: DeviceState, name: str, grid, stream_ptr: int, /, chained: bool = False, **args) -> None:
    """Launch kernel `name` with every argument named (checked against its KernelSpec); chained: see
    _Launcher.__call__."""
    state.launcher(name)(grid, stream_ptr, args, chained)


def _self_check(state: DeviceState) -> bool:
    """Run one small kernel through the direct launch and through CuPy's: True if they agree."""
    try:
        dev = state.device
        with torch.cuda.device(dev):
            ramp = torch.arange(37, dtype=torch.float32, device=dev).reshape(1, 37).repeat(5, 1)
            probs = torch.softmax(ramp * 0.1, -1)
            u = torch.tensor([0.01, 0.3, 0.5, 0.8, 0.999], dtype=torch.float32, device=dev)
            direct = torch.full((5,), -7, dtype=torch.long, device=dev)
            via_cupy = torch.full((5,), -7, dtype=torch.long, device=dev)
            ln = _Launcher(state, "sp_sample_probs")
            sp = _raw_stream(state.index)
            args = {"probs": probs.data_ptr(), "R": 5, "V": 37, "uniforms": u.data_ptr()}
            ln.struct.pack_into(ln.buf, 0, *ln.spec.values({**args, "tok_out": direct.data_ptr()}))
            ln.launch_packed((5, 1), sp)
            ln.launch_cupy((5, 1), sp, ln.spec.values({**args, "tok_out": via_cupy.data_ptr()}))
            return bool(torch.equal(direct, via_cupy)) and int(direct.min()) >= 0
    except Exception as exc:  # pragma: no cover - depends on the CuPy build
        log.warning("direct kernel launch unavailable (%s); using CuPy's launch", exc)
        return False


def warm_up(device=None) -> None:
    """Compile (or load from CuPy's cache) every kernel for `device` (default: torch's current device)."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    _device(dev.index if dev.index is not None else torch.cuda.current_device())


def check_nan(sync: bool = True) -> None:
    """Raise ValueError if a kernel has seen NaN logits since the last check (synchronises first if sync)."""
    if sync:
        torch.cuda.current_stream().synchronize()
    _raise_pending_nan()


def _raise_pending_nan() -> None:
    if _nan_view[0]:
        _nan_view[0] = 0
        raise ValueError("NaN in logits (seen by a CUDA sampling/verification kernel; outputs marked -1/NaN)")


def _after_call() -> None:
    if EAGER_NAN_CHECK:
        check_nan(sync=True)


# ----------------------------------------------------------------------------------------------- arguments
def _check_logits(logits: torch.Tensor, name: str = "logits") -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or not logits.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor")
    if logits.dtype not in _DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {logits.dtype}")
    v = logits.shape[-1] if logits.dim() else 0
    if v < 1 or v > MAX_V:
        raise ValueError(f"{name}: vocabulary size {v} outside 1..{MAX_V}")
    return logits if logits.is_contiguous() else logits.contiguous()


def _check_tensor(t: torch.Tensor, shape: tuple, dev_index: int, name: str,
                  dtype: torch.dtype) -> torch.Tensor:
    """t of this shape on cuda:dev_index, as a contiguous tensor of dtype (converted where it is not)."""
    if not isinstance(t, torch.Tensor) or t.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {getattr(t, 'shape', None)}")
    if t.get_device() != dev_index:
        raise ValueError(f"{name} must be on cuda:{dev_index}, got {t.device}")
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


def _check_f32(t: torch.Tensor, shape: tuple, dev_index: int, name: str) -> torch.Tensor:
    return _check_tensor(t, shape, dev_index, name, torch.float32)


def _check_long(t: torch.Tensor, shape: tuple, dev_index: int, name: str) -> torch.Tensor:
    return _check_tensor(t, shape, dev_index, name, torch.int64)


# The kernels' warp arguments (the .cu's struct Cfg) as plain Python numbers
_WarpCfg = namedtuple("_WarpCfg", WARP_ARGS)
_cfg_cache: dict = {}  # (temperature, top_k, top_p, vocab) -> _WarpCfg


def _warp_cfg(temperature: float, top_k: int, top_p: float, vocab: int) -> _WarpCfg:
    """The warp arguments of a sampling setting (cached per setting)."""
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
    cfg = _WarpCfg(float(inv_t), 1 if greedy else 0, k if use_k else 0, 1 if use_p else 0, tp_fixed)
    if len(_cfg_cache) > 4096:
        _cfg_cache.clear()
    _cfg_cache[key] = cfg
    return cfg


_GREEDY_CFG = _WarpCfg(1.0, 0, 0, 0, 0)  # greedy verification: the kernels want T = 1 without top-k / top-p


def _use_wide(cfg: _WarpCfg, vocab: int) -> bool:
    """The wide kernel does no top-k / top-p, and pays off from WIDE_MIN_V tokens (read at call time)."""
    return bool(WIDE_MIN_V) and vocab >= WIDE_MIN_V and cfg.top_k == 0 and cfg.use_topp == 0


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
    if mode == _MODE_SAMPLE:
        u = _check_f32(uniforms, (rows,), di, "uniforms")
        tokens = torch.empty(rows, dtype=torch.long, device=dev)
        probs = torch.empty(rows, dtype=torch.float32, device=dev)
        if rows > 0:
            state, sp = _device(di), _raw_stream(di)
            if _use_wide(cfg, vocab):
                chunks = wide_chunks(vocab)
                ws = state.wide_workspace(sp, rows, 1, chunks)
                _launch(state, f"sp_wide<{tname}>", (state.wide_grid(rows * chunks), 1), sp,
                        logits=flat.data_ptr(), B=rows, N=0, V=vocab, draft=NULL, q=NULL,
                        uniforms=u.data_ptr(), inv_t=cfg.inv_t, greedy=cfg.greedy, kind=_KIND_SAMPLE,
                        ws=ws.ws_ptr, sync=ws.sync_ptr, out_i=NULL, out_f=NULL, tested=NULL,
                        tok_out=tokens.data_ptr(), prob_out=probs.data_ptr(), nan_flag=_NAN_INT)
            else:
                _launch(state, f"sp_sample<{tname}>", (rows, 1), sp,
                        logits=flat.data_ptr(), R=rows, V=vocab, uniforms=u.data_ptr(), inv_t=cfg.inv_t,
                        greedy=cfg.greedy, top_k=cfg.top_k, use_topp=cfg.use_topp, tp_fixed=cfg.tp_fixed,
                        mode=_MODE_SAMPLE, tok_out=tokens.data_ptr(), prob_out=probs.data_ptr(),
                        probs_out=NULL, nan_flag=_NAN_INT)
        _after_call()
        return tokens, probs
    out = torch.empty(flat.shape, dtype=torch.float32, device=dev)
    if rows > 0:
        _launch(_device(di), f"sp_sample<{tname}>", (rows, 1), _raw_stream(di),
                logits=flat.data_ptr(), R=rows, V=vocab, uniforms=NULL, inv_t=cfg.inv_t, greedy=cfg.greedy,
                top_k=cfg.top_k, use_topp=cfg.use_topp, tp_fixed=cfg.tp_fixed, mode=_MODE_WARP, tok_out=NULL,
                prob_out=NULL, probs_out=out.data_ptr(), nan_flag=_NAN_INT)
    _after_call()
    return out.reshape(logits.shape)


def warp_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution of logits [..., V] -> probs [..., V] float32 (see reference.warp_probs)."""
    return _sample_rows(logits, None, temperature, top_k, top_p, mode=_MODE_WARP)


def sample(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_k: int = 0,
           top_p: float = 1.0):
    """logits [R, V], uniforms [R] -> (tokens [R] int64, token_probs [R] float32) (see reference.sample)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be [R, V], got {tuple(getattr(logits, 'shape', ()))}")
    return _sample_rows(logits, uniforms, temperature, top_k, top_p, mode=_MODE_SAMPLE)


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
        _launch(_device(di), "sp_sample_probs", (rows, 1), _raw_stream(di),
                probs=probs.data_ptr(), R=rows, V=vocab, uniforms=u.data_ptr(), tok_out=tokens.data_ptr())
    return tokens


# ----------------------------------------------------------------------------------------------- verification
def _device_parents(state: DeviceState, parents: torch.Tensor, n: int) -> torch.Tensor:
    if not isinstance(parents, torch.Tensor) or tuple(parents.shape) != (n,):
        raise ValueError(f"parents must have shape ({n},)")
    if parents.device.type == "cuda":  # used as given (validating it would need a host sync)
        if parents.device != state.device:
            raise ValueError(f"parents must be on {state.device} or the CPU")
        if parents.dtype == torch.int64 and parents.is_contiguous():
            return parents
        return parents.long().contiguous()
    plist = tuple(int(p) for p in parents.tolist())
    t = state.parents.get(plist)
    if t is None:
        for i, p in enumerate(plist):
            if not -1 <= p < i:
                raise ValueError("parents must be topologically ordered (-1 <= parents[i] < i); "
                                 f"parents[{i}] = {p}")
        t = state.parents[plist] = torch.tensor(plist, dtype=torch.int64, device=state.device)
    return t


def _chain_parents(state: DeviceState, n: int) -> torch.Tensor:
    key = ("chain", n)
    t = state.parents.get(key)
    if t is None:
        t = state.parents[key] = torch.arange(-1, n - 1, dtype=torch.int64, device=state.device)
    return t


def _verify(target_logits, draft_tokens, parents, draft_probs, uniforms, temperature, top_k, top_p,
            greedy_verify: bool, chain: bool, chained: bool = False) -> VerifyResult:
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
    wide = chain and _use_wide(cfg, vocab)
    state = _device(di)
    par = None if wide else (_chain_parents(state, n) if chain else _device_parents(state, parents, n))
    if batch > 0:
        sp = _raw_stream(di)
        qp = NULL if q is None else q.data_ptr()
        up = NULL if u is None else u.data_ptr()
        tname = _DTYPES[logits.dtype]
        if wide:
            chunks = wide_chunks(vocab)
            ws = state.wide_workspace(sp, batch, n1, chunks)
            kind = _KIND_VERIFY_GREEDY if greedy_verify else _KIND_VERIFY_STOCHASTIC
            grid = (state.wide_grid(batch * n1 * chunks), 1)
            _launch(state, f"sp_wide<{tname}>", grid, sp, chained=chained,
                    logits=logits.data_ptr(), B=batch, N=n, V=vocab, draft=draft.data_ptr(), q=qp,
                    uniforms=up, inv_t=cfg.inv_t, greedy=cfg.greedy, kind=kind, ws=ws.ws_ptr,
                    sync=ws.sync_ptr, out_i=ints.data_ptr(), out_f=floats.data_ptr(),
                    tested=tested.data_ptr(), tok_out=NULL, prob_out=NULL, nan_flag=_NAN_INT)
        else:
            ws = state.verify_workspace(sp, batch * n1, batch, vocab)
            _launch(state, f"sp_verify<{tname}>", (n1, batch), sp, chained=chained,
                    logits=logits.data_ptr(), B=batch, N=n, V=vocab, draft=draft.data_ptr(),
                    parents=par.data_ptr(), q=qp, uniforms=up, inv_t=cfg.inv_t, greedy=cfg.greedy,
                    top_k=cfg.top_k, use_topp=cfg.use_topp, tp_fixed=cfg.tp_fixed,
                    greedy_verify=1 if greedy_verify else 0, stats=ws.stats_ptr, counters=ws.counters_ptr,
                    scratch=ws.scratch_ptr, out_i=ints.data_ptr(), out_f=floats.data_ptr(),
                    tested=tested.data_ptr(), nan_flag=_NAN_INT)
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
                        path=torch.empty(batch, 0, dtype=torch.long, device=dev), p_draft=empty_f,
                        q_draft=empty_f, accept_prob=empty_f,
                        tested=torch.empty(batch, 0, dtype=torch.bool, device=dev))


def verify_tree_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                       parents: torch.Tensor, chained: bool = False) -> VerifyResult:
    """Greedy tree verification (see reference.verify_tree_greedy). chained: the logits' kernel is one of
    ours (the step's LM head in sp_gemv), so the launch may be programmatic (_Launcher.__call__)."""
    return _verify(target_logits, draft_tokens, parents, None, None, 1.0, 0, 1.0, greedy_verify=True,
                   chain=False, chained=chained)


def verify_tree_stochastic(target_logits: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor,
                           draft_probs: Optional[torch.Tensor], uniforms: torch.Tensor, temperature: float,
                           top_k: int = 0, top_p: float = 1.0) -> VerifyResult:
    """Recursive rejection sampling over a token tree (see reference.verify_tree_stochastic)."""
    return _verify(target_logits, draft_tokens, parents, draft_probs, uniforms, temperature, top_k, top_p,
                   greedy_verify=False, chain=False)


def verify_chain_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                        chained: bool = False) -> VerifyResult:
    """Greedy chain verification (see reference.verify_chain_greedy); chained: as verify_tree_greedy's."""
    return _verify(target_logits, draft_tokens, None, None, None, 1.0, 0, 1.0, greedy_verify=True, chain=True,
                   chained=chained)


def verify_chain_stochastic(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                            draft_probs: Optional[torch.Tensor], uniforms: torch.Tensor, temperature: float,
                            top_k: int = 0, top_p: float = 1.0) -> VerifyResult:
    """Standard speculative sampling over a chain (see reference.verify_chain_stochastic)."""
    return _verify(target_logits, draft_tokens, None, draft_probs, uniforms, temperature, top_k, top_p,
                   greedy_verify=False, chain=True)


# ----------------------------------------------------------------------------------------------- readout
def readout(logits: torch.Tensor, result: VerifyResult, draft_tokens: torch.Tensor, temperature: float,
            width: int, extra: int = 0, chained: bool = False) -> torch.Tensor:
    """A round's one host copy, by sp_readout in one launch (see reference.readout): it replaces a softmax,
    a top-k, a gather and a cat of eleven pieces, each a few microseconds of host time a round. extra: slots
    after the values, left unwritten for the caller's kernels to fill. chained: the stream's last kernel
    (the verification's) is one of ours, so the launch may be programmatic (_Launcher.__call__)."""
    logits, rows, vocab, n = _readout_logits(logits, width)
    di = logits.get_device()
    accepted, next_token = (_readout_piece(t, 1, torch.int64, di, name) for t, name in
                            ((result.accepted[:1], "accepted"), (result.next_token[:1], "next_token")))
    path, draft = (_readout_piece(t, n, torch.int64, di, name) for t, name in
                   ((result.path[0], "path"), (draft_tokens, "draft_tokens")))
    p, q, accept = (_readout_piece(t, n, torch.float32, di, name) for t, name in
                    ((result.p_draft[0], "p_draft"), (result.q_draft[0], "q_draft"),
                     (result.accept_prob[0], "accept_prob")))
    tested = _readout_piece(result.tested[0], n, torch.bool, di, "tested")
    out = torch.empty(2 + 6 * n + rows + 2 * rows * width + extra, dtype=torch.float32, device=logits.device)

    def ptr(t: torch.Tensor) -> int:
        return t.data_ptr() if t.numel() else NULL

    _launch(_device(di), f"sp_readout<{_DTYPES[logits.dtype]}>", (rows, 1), _raw_stream(di), chained=chained,
            logits=logits.data_ptr(), R=rows, V=vocab, inv_t=_warp_cfg(temperature, 0, 1.0, vocab).inv_t,
            W=width, accepted=ptr(accepted), next_token=ptr(next_token), path=ptr(path), draft=ptr(draft),
            p_draft=ptr(p), q_draft=ptr(q), accept_prob=ptr(accept), tested=ptr(tested), out=out.data_ptr())
    return out


def greedy_readout(logits: torch.Tensor, draft_tokens: torch.Tensor, width: int,
                   parents: Optional[torch.Tensor] = None, limit: Optional[torch.Tensor] = None,
                   extra: int = 0, chained: bool = False) -> tuple:
    """A greedy round's verification and readout by sp_greedy_readout in one launch (see
    reference.greedy_readout): on a small model each launch of a round is a few microseconds, and this one
    replaces three (the verification, n-gram's cut, the readout; plain decoding's argmax and readout).
    logits [N+1, V], draft_tokens [N], parents [N] or None (a chain), limit [1] int64 or None (a chain's real
    drafts). extra: slots after the values, left unwritten for the caller's kernels. chained: the logits'
    kernel is one of ours, so the launch may be programmatic. Returns (VerifyResult, readout values)."""
    if _nan_view[0]:
        _raise_pending_nan()
    logits, rows, vocab, n = _readout_logits(logits, width)
    if limit is not None and (parents is not None or n == 0):
        raise ValueError("limit cuts a chain of at least one draft")
    di = logits.get_device()
    state = _device(di)
    draft = _check_long(draft_tokens, (n,), di, "draft_tokens")
    par = NULL if parents is None else _device_parents(state, parents, n).data_ptr()
    cut = NULL if limit is None else _check_long(limit, (1,), di, "limit").data_ptr()
    dev = logits.device
    ints = torch.empty(1, 2 + n, dtype=torch.long, device=dev)
    floats = torch.empty(3, 1, n, dtype=torch.float32, device=dev)
    tested = torch.empty(1, n, dtype=torch.bool, device=dev)
    out = torch.empty(2 + 6 * n + rows + 2 * rows * width + extra, dtype=torch.float32, device=dev)
    sp = _raw_stream(di)
    ws = state.verify_workspace(sp, rows, 1, 0)
    _launch(state, f"sp_greedy_readout<{_DTYPES[logits.dtype]}>", (rows, 1), sp, chained=chained,
            logits=logits.data_ptr(), R=rows, V=vocab, W=width, draft=draft.data_ptr() if n else NULL,
            parents=par, limit=cut, stats=ws.stats_ptr, counter=ws.counters_ptr, out_i=ints.data_ptr(),
            out_f=floats.data_ptr(), tested=tested.data_ptr(), out=out.data_ptr(), nan_flag=_NAN_INT)
    _after_call()
    result = VerifyResult(accepted=ints[:, 0], next_token=ints[:, 1], path=ints[:, 2:], p_draft=floats[0],
                          q_draft=floats[1], accept_prob=floats[2], tested=tested)
    return result, out


def _readout_logits(logits: torch.Tensor, width: int) -> tuple:
    """A readout's logits [N+1, V] and width, checked: (logits, rows, vocab, n)."""
    logits = _check_logits(logits, "logits")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N+1, V], got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    n = rows - 1
    if not 1 <= width <= min(vocab, READ_MAX_W):
        raise ValueError(f"width must be in 1..{min(vocab, READ_MAX_W)}, got {width}")
    if not 0 <= n <= MAX_N:
        raise ValueError(f"number of drafted nodes must be in 0..{MAX_N}, got {n}")
    return logits, rows, vocab, n


def _readout_piece(t: torch.Tensor, size: int, dtype: torch.dtype, dev_index: int, name: str) -> torch.Tensor:
    """One input of sp_readout: [size] of dtype on the logits' device, contiguous (converted if needed)."""
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != (size,):
        raise ValueError(f"{name} must have shape ({size},), got {getattr(t, 'shape', None)}")
    if size and t.get_device() != dev_index:
        raise ValueError(f"{name} must be on cuda:{dev_index}, got {t.device}")
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


# ----------------------------------------------------------------------------------------------- backend
class CudaBackend(ModuleBackend):
    """The CuPy raw kernels of this module as an `engine.kernels.Backend`."""

    def __init__(self):
        super().__init__("cupy-raw-kernels", sys.modules[__name__], compiles_kernels=True,
                         flags_nan_on_device=True, warm_up=warm_up, check_nan=check_nan)


BACKEND = CudaBackend()
