"""Verification and sampling backends: CuPy raw kernels on CUDA, the torch reference elsewhere.

`select_backend(device)` returns a module-like object with the functions of `kernels.reference`
(warp_probs, sample_from_probs, sample, verify_chain_greedy, verify_chain_stochastic, verify_tree_greedy,
verify_tree_stochastic) and a `name`.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from kernels import reference

_FUNCTIONS = ("warp_probs", "sample_from_probs", "sample", "verify_chain_greedy", "verify_chain_stochastic",
              "verify_tree_greedy", "verify_tree_stochastic")

REFERENCE = SimpleNamespace(name="torch-reference", compiles_kernels=False, flags_nan_on_device=False,
                            warm_up=lambda device=None: None, check_nan=lambda sync=True: None, **{f: getattr(reference, f) for f in _FUNCTIONS})


def select_backend(device: torch.device):
    """CUDA + CuPy -> the raw kernels; otherwise the torch reference."""
    if torch.device(device).type == "cuda":
        try:
            from kernels import cuda as cuda_backend  # noqa: F401  (needs CuPy)
        except ImportError:
            return REFERENCE
        return cuda_backend.BACKEND
    return REFERENCE
