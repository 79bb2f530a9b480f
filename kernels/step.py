"""Fused kernels of the decoder step (kernels/step_kernels.cu) and their torch reference twins.

`rope_qkv` replaces the step's rotary embedding (3 kernels), the k/v cache writes (2) and q's copy into the
grouped layout SDPA reads (1); `silu_mul` replaces SiLU and the product with up (2). The twins are the eager
step's own operations, and the fuzz test (tests/test_step_kernels_gpu.py) holds the kernels to them.

Launches go through CuPy on torch's current stream, so a step that uses them is captured in the CUDA graph
like any torch operation; their Python cost is paid once, at capture. `StepKernels.load(device)` returns None
where CuPy or a CUDA device is missing, and the step then runs its torch operations.
"""
from __future__ import annotations

import os
import pathlib
import threading
from typing import Optional

import numpy as np
import torch

from kernels.launch_spec import KernelSpec, parse_kernels

SOURCE = pathlib.Path(__file__).with_name("step_kernels.cu")
THREADS = 256
_DTYPES = {torch.float32: "float", torch.bfloat16: "bf16_t", torch.float16: "f16_t"}
_NUMPY = {"Q": np.uint64, "i": np.int32, "f": np.float32}

# Written as in the .cu (tests/test_kernels_launch_spec.py-style check in tests/test_step_kernels.py).
SPECS: dict[str, KernelSpec] = {spec.name: spec for spec in (
    KernelSpec("sp_rope_qkv",
               "const T* qkv, const T* cos_table, const T* sin_table, const long long* positions, "
               "const long long* cache_index, T* k_cache, T* v_cache, T* q_out, int n, int heads, "
               "int kv_heads, int D, int cache_len", templated=True),
    KernelSpec("sp_silu_mul", "const T* gate_up, T* out, int n, int inter", templated=True),
)}


# ------------------------------------------------------------------------------------------------ twins
def rope_qkv_reference(qkv, cos_table, sin_table, positions, cache_index, k_cache, v_cache, heads: int,
                       kv_heads: int):
    """The eager step's ops: rope on q and k, k/v written at cache_index, q as [heads, n, D].
    qkv [n, (heads + 2 kv_heads) * D]; tables [max_len, D]; k_cache, v_cache [kv_heads, max_len, D]."""
    n, d = qkv.shape[0], k_cache.shape[-1]
    q_dim, kv_dim = heads * d, kv_heads * d
    cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]  # [n, 1, D]
    x = qkv[:, :q_dim + kv_dim].unflatten(-1, (-1, d))  # [n, heads + kv_heads, D]
    swapped = x.unflatten(-1, (2, d // 2)).flip(-2).flatten(-2)
    qk = torch.addcmul(x * cos, swapped, sin)
    k_cache.index_copy_(1, cache_index, qk[:, heads:].transpose(0, 1))
    v_cache.index_copy_(1, cache_index, qkv[:, q_dim + kv_dim:].view(n, kv_heads, d).transpose(0, 1))
    return qk[:, :heads].transpose(0, 1).contiguous()  # [heads, n, D]


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """[n, 2 I] (gate | up) -> SiLU(gate) * up [n, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# ------------------------------------------------------------------------------------------------ kernels
class StepKernels:
    """The compiled step kernels of one device."""

    _lock = threading.Lock()
    _loaded: dict = {}  # device index -> StepKernels or None

    def __init__(self, module, device: torch.device):
        self.device = device
        self._kernels = {f"{name}<{t}>": module.get_function(f"{name}<{t}>") for name in SPECS
                         for t in _DTYPES.values()}
        self._streams: dict = {}  # torch stream pointer -> CuPy's view of it, made once

    @classmethod
    def load(cls, device) -> Optional["StepKernels"]:
        """The kernels for a CUDA device, compiled once; None without CuPy/CUDA or with SPECPLAY_FUSED=0."""
        device = torch.device(device)
        if device.type != "cuda" or os.environ.get("SPECPLAY_FUSED", "1") == "0":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        with cls._lock:
            if index not in cls._loaded:
                cls._loaded[index] = cls._compile(torch.device("cuda", index))
            return cls._loaded[index]

    @classmethod
    def _compile(cls, device) -> Optional["StepKernels"]:
        try:
            import cupy
        except Exception:  # noqa: BLE001 - no CuPy: the step keeps its torch operations
            return None
        names = [f"{name}<{t}>" for name in SPECS for t in _DTYPES.values()]
        with cupy.cuda.Device(device.index):
            module = cupy.RawModule(code=SOURCE.read_text(), options=("--std=c++17", "--fmad=false"),
                                    name_expressions=names)
            return cls(module, device)

    def _launch(self, name: str, dtype: torch.dtype, count: int, **args) -> None:
        spec = SPECS[name]
        values = [_NUMPY[fmt](v) for fmt, v in zip(spec.layout, spec.values(args))]
        stream = self._stream(torch.cuda.current_stream(self.device).cuda_stream)
        grid = ((count + THREADS - 1) // THREADS,)
        self._kernels[f"{name}<{_DTYPES[dtype]}>"](grid, (THREADS,), tuple(values), stream=stream)

    def _stream(self, pointer: int):
        stream = self._streams.get(pointer)
        if stream is None:
            import warnings

            import cupy

            with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; 13 lacks its successor
                warnings.simplefilter("ignore", DeprecationWarning)
                stream = self._streams[pointer] = cupy.cuda.ExternalStream(pointer)
        return stream

    def rope_qkv(self, qkv, cos_table, sin_table, positions, cache_index, k_cache, v_cache, heads: int,
                 kv_heads: int) -> torch.Tensor:
        """As rope_qkv_reference; returns q [heads, n, D]. Every tensor contiguous, one dtype, one device."""
        n, d = qkv.shape[0], k_cache.shape[-1]
        _check(qkv, cos_table, sin_table, k_cache, v_cache)
        for index in (positions, cache_index):
            if index.dtype != torch.long or not index.is_contiguous() or index.numel() != n:
                raise ValueError("positions and cache_index must be contiguous int64 tensors of n entries")
        q_out = torch.empty(heads, n, d, dtype=qkv.dtype, device=qkv.device)
        self._launch("sp_rope_qkv", qkv.dtype, n * (heads + 2 * kv_heads) * d, qkv=qkv.data_ptr(),
                     cos_table=cos_table.data_ptr(), sin_table=sin_table.data_ptr(),
                     positions=positions.data_ptr(), cache_index=cache_index.data_ptr(),
                     k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(), q_out=q_out.data_ptr(), n=n,
                     heads=heads, kv_heads=kv_heads, D=d, cache_len=k_cache.shape[1])
        return q_out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        n, inter = gate_up.shape[0], gate_up.shape[1] // 2
        _check(gate_up)
        out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
        self._launch("sp_silu_mul", gate_up.dtype, n * inter, gate_up=gate_up.data_ptr(), out=out.data_ptr(),
                     n=n, inter=inter)
        return out


def _check(*tensors: torch.Tensor) -> None:
    dtype = tensors[0].dtype
    for t in tensors:
        if not t.is_contiguous() or t.dtype != dtype or t.dtype not in _DTYPES:
            raise ValueError(f"step kernels need contiguous {dtype} tensors (got {t.dtype}, "
                             f"contiguous={t.is_contiguous()})")


def source_specs() -> dict:
    """The kernels as step_kernels.cu declares them (for the signature test)."""
    return parse_kernels(SOURCE.read_text())
