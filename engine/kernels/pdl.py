"""Programmatic dependent launch: the step kernels launched through the driver's cuLaunchKernelEx with the
programmatic-stream-serialization attribute, so that on sm_90 and later a kernel starts (and issues its
weight loads) while the stream's previous kernel is still finishing.

Why: a replayed decode step is a chain of ~6 kernels per layer, each small; between two of them the GPU sits
idle while the next grid launches and its first loads travel. The kernels wait (`griddepcontrol.wait`, see
kernels/cuda_common.cuh) before they touch anything the previous kernel writes, so the results are the same
bit for bit; what overlaps is the launch and the weight prefetch. Launches captured in a CUDA graph keep the
programmatic edge.

CuPy's RawKernel launch takes no launch attributes, hence the driver call through ctypes. A launch is
programmatic only when its caller knows the previous kernel on the stream is one of ours (`chained` in
step.py): captured into a graph, a programmatic launch after a memset node (which cuBLAS may queue)
invalidates the capture.

On from sm_90. Measured on an H200 it cut plain decoding of a 1B shape from
1.734 to 1.520 ms a token (an earlier machine: 1.525 to 1.420), and a replayed 1B step from 1.150 to 1.077 ms
(docs/measurements/round_gap_llama-1b_pdl*_before_readout.txt). It was opt-in while one GPU run of three
with it lost a capture (an EAGLE-3 head's sampled chain in bf16, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED); a
later run without it lost the same capture, so launch is not the cause, and a failed capture is now retried
(engine.core.graphs._capture).
`PdlLauncher.load` returns None where the driver lacks cuLaunchKernelEx, the device is older than sm_90, or
the variable is not 1; the caller then launches through CuPy. A failed launch turns the launcher off for the
process.
"""
from __future__ import annotations

import ctypes
from typing import Optional

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)
_CTYPES = {"Q": ctypes.c_uint64, "i": ctypes.c_int32, "f": ctypes.c_float}


class _Attribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig, as cuda.h declares it
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("numAttrs", ctypes.c_uint)]


def _attribute() -> _Attribute:
    attribute = _Attribute()
    attribute.id = PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.value[0] = 1  # programmaticStreamSerializationAllowed
    return attribute


class PdlLauncher:
    def __init__(self, launch_ex):
        self._launch_ex = launch_ex
        self._attribute = _attribute()
        self.enabled = True
        self.failure = ""

    @classmethod
    def load(cls, capability: tuple) -> Optional["PdlLauncher"]:
        if tuple(capability) < (9, 0):
            return None
        try:
            driver = ctypes.CDLL("libcuda.so.1")
            launch_ex = driver.cuLaunchKernelEx
        except (OSError, AttributeError):
            return None
        launch_ex.restype = ctypes.c_int
        launch_ex.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                              ctypes.c_void_p]
        return cls(launch_ex)

    def launch(self, function_ptr: int, grid: tuple, threads: int, stream_ptr: int, layout: str,
               values: list) -> bool:
        """Launch; False (and the launcher off from then on) if the driver refused, so the caller launches
        the usual way. layout: one struct format character per argument (Q, i or f)."""
        if not self.enabled:
            return False
        if not function_ptr:
            self.enabled, self.failure = False, "no CUfunction handle for the kernel"
            return False
        args = [_CTYPES[fmt](int(v) if fmt != "f" else float(v)) for fmt, v in zip(layout, values)]
        pointers = [ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args]
        params = (ctypes.c_void_p * len(args))(*pointers)
        return self.launch_params(function_ptr, grid, threads, stream_ptr, params)

    def launch_params(self, function_ptr: int, grid: tuple, threads: int, stream_ptr: int, params) -> bool:
        """launch() with the kernel's parameter array made by the caller (cuda.py packs its own): a
        ctypes array of pointers to the arguments."""
        if not self.enabled:
            return False
        grid = tuple(grid) + (1,) * (3 - len(grid))
        config = _Config(grid[0], grid[1], grid[2], threads, 1, 1, 0, stream_ptr,
                         ctypes.pointer(self._attribute), 1)
        result = self._launch_ex(ctypes.byref(config), function_ptr, params, None)
        if result != 0:
            self.enabled, self.failure = False, f"cuLaunchKernelEx returned CUDA error {result}"
            return False
        return True
