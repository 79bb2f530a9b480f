"""The drafter interface: every draft method proposes a chain or a tree; the decoder verifies it."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.config import GenerationConfig
from engine.runner import to_device


@dataclass
class Draft:
    tokens: torch.Tensor  # [N] int64 on the target's device
    # [N] int64 on the host, topological order, -1 = last committed token; None = chain. On the host because
    # the tree's shape drives host-side work (masks, the event); reading it from the GPU would stall a round.
    parents: Optional[torch.Tensor] = None
    probs: Optional[torch.Tensor] = None  # [N, V] float32: the distribution node i was drawn from; None = one-hot

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    @property
    def is_tree(self) -> bool:
        return self.parents is not None


@dataclass
class DecodeState:
    """What a drafter may read: the committed tokens (prompt + generated) and the round's settings."""

    tokens: list  # committed token ids; the last one is not yet in the target's cache
    prompt_len: int
    config: GenerationConfig
    generator: torch.Generator  # CPU generator: every uniform of a run comes from it (reproducible runs)
    backend: object  # kernels backend (sampling / verification functions)
    vocab_size: int
    device: torch.device
    extras: dict = field(default_factory=dict)  # e.g. the target's last features for Medusa / EAGLE

    def uniforms(self, n: int) -> torch.Tensor:
        """n uniforms in [0, 1) from the run's generator, on the decoding device."""
        return to_device(torch.rand(n, generator=self.generator, dtype=torch.float32), self.device, torch.float32)


def draw_token(state: DecodeState, logits: torch.Tensor, uniform: torch.Tensor):
    """Draw one draft token from logits [1, V] with the run's sampling settings.

    Returns (token [1], q [1, V] or None): greedy drafting takes the argmax and needs no q (verification is
    then the argmax check); otherwise q is the warped distribution the token was sampled from."""
    sampling = state.config.sampling
    if sampling.greedy:
        return logits.argmax(-1), None
    q = state.backend.warp_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    return state.backend.sample_from_probs(q, uniform), q


class Drafter(ABC):
    name: str = ""

    def start(self, state: DecodeState) -> None:
        """A new generation begins (state.tokens is the prompt): reset and prefill any caches."""

    @abstractmethod
    def propose(self, state: DecodeState, k: int) -> Draft:
        """Draft up to k tokens (a chain) or a tree after state.tokens."""

    def commit(self, state: DecodeState, accepted: int) -> None:
        """The last draft's first `accepted` tokens (the accepted path) were kept and state.tokens extended."""


class NoDrafter(Drafter):
    """Plain autoregressive decoding: an empty draft, so each round emits exactly the target's next token."""

    name = "none"

    def propose(self, state: DecodeState, k: int) -> Draft:
        return Draft(tokens=torch.zeros(0, dtype=torch.long, device=state.device))
