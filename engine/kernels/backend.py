"""What a sampling/verification backend offers (`Backend`), and the torch reference as one.

The engine is written against `Backend` only: it asks `compiles_kernels` and `flags_nan_on_device` rather than
which backend it holds.
"""
from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch

from engine.kernels import reference
from engine.kernels.reference import VerifyResult

FUNCTIONS = ("warp_probs", "sample_from_probs", "sample", "verify_chain_greedy", "verify_chain_stochastic",
             "verify_tree_greedy", "verify_tree_stochastic", "readout", "greedy_readout")
MEMBERS = ("name", "compiles_kernels", "flags_nan_on_device", "warm_up", "check_nan") + FUNCTIONS


@runtime_checkable
class Backend(Protocol):
    """The functions of `reference` (same arguments, same results) and what sets a backend apart."""

    name: str
    compiles_kernels: bool  # warm_up() compiles kernels (worth saying "compiling…" while it runs)
    flags_nan_on_device: bool  # NaN logits give -1 tokens / accepted counts: the caller need not check

    def warm_up(self, device=None) -> None:
        """Do the one-off work (compiling kernels) now rather than in the first call."""

    def check_nan(self, sync: bool = True) -> None:
        """Raise ValueError if a call since the last check has seen NaN logits."""

    def warp_probs(self, logits: torch.Tensor, temperature: float, top_k: int = 0,
                   top_p: float = 1.0) -> torch.Tensor: ...

    def sample_from_probs(self, probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor: ...

    def sample(self, logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_k: int = 0,
               top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]: ...

    def verify_chain_greedy(self, target_logits: torch.Tensor,
                            draft_tokens: torch.Tensor) -> VerifyResult: ...

    def verify_chain_stochastic(self, target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                                draft_probs: Optional[torch.Tensor], uniforms: torch.Tensor,
                                temperature: float, top_k: int = 0, top_p: float = 1.0) -> VerifyResult: ...

    def verify_tree_greedy(self, target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                           parents: torch.Tensor) -> VerifyResult: ...

    def verify_tree_stochastic(self, target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                               parents: torch.Tensor, draft_probs: Optional[torch.Tensor],
                               uniforms: torch.Tensor, temperature: float, top_k: int = 0,
                               top_p: float = 1.0) -> VerifyResult: ...

    def readout(self, logits: torch.Tensor, result: VerifyResult, draft_tokens: torch.Tensor,
                temperature: float, width: int, extra: int = 0) -> torch.Tensor: ...

    def greedy_readout(self, logits: torch.Tensor, draft_tokens: torch.Tensor, width: int,
                       parents: Optional[torch.Tensor] = None, limit: Optional[torch.Tensor] = None,
                       extra: int = 0) -> tuple: ...


class ModuleBackend:
    """A Backend whose functions are a module's (the names in FUNCTIONS).

    Every member is an instance attribute, so `vars(backend)` is the whole backend: callers copy a backend
    that way with one function replaced (see tests/test_lossless.py).
    """

    def __init__(self, name: str, module, *, compiles_kernels: bool, flags_nan_on_device: bool, warm_up,
                 check_nan):
        self.name = name
        self.compiles_kernels = compiles_kernels
        self.flags_nan_on_device = flags_nan_on_device
        self.warm_up = warm_up
        self.check_nan = check_nan
        for function in FUNCTIONS:
            setattr(self, function, getattr(module, function))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def _nothing_to_compile(device=None) -> None:
    """The reference runs torch ops: nothing to warm up."""


def _nan_already_raised(sync: bool = True) -> None:
    """The reference raises ValueError on NaN logits inside the call itself: nothing is pending."""


class ReferenceBackend(ModuleBackend):
    """The torch reference (`engine.kernels.reference`), on any device."""

    def __init__(self):
        super().__init__("torch-reference", reference, compiles_kernels=False, flags_nan_on_device=False,
                         warm_up=_nothing_to_compile, check_nan=_nan_already_raised)
