"""Verification and sampling backends: CuPy raw kernels on CUDA, the torch reference elsewhere.

`select_backend(device)` returns a `Backend` (backend.py): the functions of `engine.kernels.reference`
(warp_probs, sample_from_probs, sample, verify_chain_greedy, verify_chain_stochastic, verify_tree_greedy,
verify_tree_stochastic), `warm_up`, `check_nan`, a `name` and the flags `compiles_kernels` and
`flags_nan_on_device`.
"""
from __future__ import annotations

import torch

from engine.kernels.backend import Backend, ReferenceBackend

__all__ = ["Backend", "REFERENCE", "ReferenceBackend", "select_backend"]

REFERENCE = ReferenceBackend()


def select_backend(device: torch.device) -> Backend:
    """CUDA + CuPy -> the raw kernels (`engine.kernels.cuda.BACKEND`); otherwise the torch reference."""
    if torch.device(device).type == "cuda":
        try:
            from engine.kernels import cuda as cuda_backend  # needs CuPy
        except ImportError:
            return REFERENCE
        return cuda_backend.BACKEND
    return REFERENCE
