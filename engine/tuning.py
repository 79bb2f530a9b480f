"""The engine's switches, read once: what a run may use on a GPU.

Every experiment the engine ran (fused rounds, round graphs, kernels for each step, programmatic launches,
tile sizes ...) is decided and its losing arm deleted (tag `before-house-cleanup` keeps them); the numeric
tunings are constants beside the kernels they tune. Two switches remain, for diagnosis, not for speed:

- SPECPLAY_TORCH_TWINS=1: the torch twins run in place of the CUDA kernels (verification, sampling and the
  step's fused kernels): a run that differs from the default points at a kernel.
- SPECPLAY_NO_GRAPHS=1: nothing is captured as a CUDA graph (every launch is a plain launch): a run that
  differs from the default points at a capture.

Two more are for people, not for the engine: SPECPLAY_PROGRESS=1 (progress lines when stderr is not a
terminal) and SPECPLAY_DEBUG=1 (a traceback with an internal error), both read by the CLI.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional


@dataclass(frozen=True)
class Tuning:
    kernels: bool = True  # False: the torch twins in place of the CUDA kernels
    graphs: bool = True  # False: no CUDA graph capture

    @classmethod
    def from_environment(cls, environ: Optional[Mapping[str, str]] = None) -> "Tuning":
        env = os.environ if environ is None else environ
        return cls(kernels=env.get("SPECPLAY_TORCH_TWINS", "0") != "1",
                   graphs=env.get("SPECPLAY_NO_GRAPHS", "0") != "1")


ENVIRONMENT = Tuning.from_environment()  # what this process was started with
