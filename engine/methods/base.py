"""The drafter interface: every draft method proposes a chain or a tree; the decoder verifies it."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional

import torch

from engine.models.runner import to_device

if TYPE_CHECKING:  # a type only: engine.config -> engine.methods.registry -> the drafters -> here
    from engine.config import GenerationConfig


@dataclass
class Draft:
    # [N] int64 on the target's device; a tree drafted on the host may leave them there with its parents (the
    # decoder uploads them with the round's other inputs)
    tokens: torch.Tensor
    # [N] int64, topological order, -1 = last committed token; None = chain. On the host, where the tree's
    # shape drives host-side work (masks, the event), unless tree_block is given: then on the device, and the
    # decoder copies it back with the round's readout (reading it mid-round would stall the GPU).
    parents: Optional[torch.Tensor] = None
    # [N, V] float32: the distribution node i was drawn from; None = one-hot
    probs: Optional[torch.Tensor] = None
    # a tree drafted on the device: the verification block's (depth [N+1], visible [N+1, N+1] bool), row 0 the
    # last committed token, for a target that takes device trees (LlamaRunner.forward's tree)
    tree_block: Optional[tuple] = None

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

    def uniforms(self, n: int) -> torch.Tensor:
        """n uniforms in [0, 1) from the run's generator, on the decoding device."""
        uniforms = torch.rand(n, generator=self.generator, dtype=torch.float32)
        return to_device(uniforms, self.device, torch.float32)


def draw_token(state: DecodeState, logits: torch.Tensor, uniform: torch.Tensor):
    """Draw one draft token from logits [1, V] with the run's sampling settings.

    Returns (token [1], q [1, V] or None): greedy drafting takes the argmax and needs no q (verification is
    then the argmax check); otherwise q is the warped distribution the token was sampled from."""
    sampling = state.config.sampling
    if sampling.greedy:
        return logits.argmax(-1), None
    q = state.backend.warp_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    return state.backend.sample_from_probs(q, uniform), q


@dataclass(frozen=True)
class DrafterNeeds:
    """What a drafter reads from the target besides the tokens; the decoder hands over only these."""

    prefill_features: bool = False  # the target's features over the prompt (EAGLE starts from them)
    # the verified block's features (EAGLE feeds them, Medusa reads the last one)
    block_features: bool = False
    block_logits: bool = False  # the verified block's logits
    # the target's argmax at each row of the verified block, from the round's readout (lookahead's Jacobi
    # update: no second copy from the device)
    block_argmax: bool = False
    # target layers whose outputs, side by side, replace the last layer's as the features above (EAGLE-3's
    # fused low/middle/high features; needs engine.models.llama.LlamaRunner's tap_layers)
    tap_layers: tuple = ()


@dataclass(frozen=True)
class DraftStart:
    """What a drafter gets when a generation begins."""

    prompt: list  # prompt token ids (== state.tokens at the start)
    # [P-1, H] target features of positions 0..P-2 (if needed; [P-1, taps * H] with tap_layers)
    prefill_features: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class RoundCommit:
    """What a drafter gets after verification: the outcome of its last draft. state.tokens already holds the
    round's emitted tokens. Rows index the verified block: row 0 is the last committed token, row i + 1 is
    draft node i."""

    accepted: int  # drafted tokens accepted (the accepted path's length)
    accepted_rows: list  # [accepted + 1] block rows now committed: 0 and the accepted path's rows
    draft_tokens: list  # the round's draft token ids, on the host
    # [N+1, H] the target's last-layer features (if needed; [N+1, taps * H] with tap_layers)
    block_features: Optional[torch.Tensor] = None
    block_logits: Optional[torch.Tensor] = None  # [N+1, V] the target's logits (if needed)
    block_argmax: Optional[list] = None  # [N+1] the target's most likely token at each row (if needed)
    # the round after this one, queued already, was a round graph's replay: it took this round's outcome on
    # the device, and fed the drafter (EAGLE's head) the accepted rows there
    fed_ahead: bool = False

    @property
    def last_feature(self) -> Optional[torch.Tensor]:
        """[H] the feature of the last accepted row: the one that gave the round's correction or bonus
        token."""
        return None if self.block_features is None else self.block_features[self.accepted_rows[-1]]


class Drafter(ABC):
    name: str = ""
    needs: ClassVar[DrafterNeeds] = DrafterNeeds()

    def start(self, state: DecodeState, start: DraftStart) -> None:  # noqa: B027 optional hook
        """A new generation begins (state.tokens is the prompt): reset and prefill any caches."""

    @abstractmethod
    def propose(self, state: DecodeState, k: int) -> Draft:
        """Draft up to k tokens (a chain) or a tree after state.tokens."""

    def verified(self, state: DecodeState, features: torch.Tensor) -> None:  # noqa: B027 optional hook
        """The round's verification and readout are queued on the GPU (never called on the CPU); features
        [N+1, H] are the block's target features, not yet computed. Work queued here runs on the GPU while
        the host waits for the readout and commits: the next draft's work, before the outcome is known."""

    def commit(self, state: DecodeState, commit: RoundCommit) -> None:  # noqa: B027 optional hook
        """The last draft's accepted path was kept and state.tokens extended."""

    # whether round_graph may offer a round to queue behind an unread one (GPU)
    replays_rounds: ClassVar[bool] = False
    # whether its drafts are made on the host, trees or nothing (suffix decoding, lookahead): on the GPU the
    # decoder verifies them by one upload and one graph replay (engine.core.graphs.HostTreeRoundGraph)
    drafts_on_host: ClassVar[bool] = False

    def round_graph(self, state: DecodeState, config, width: int):
        """A whole round captured as one graph that feeds itself on the device (engine.core.graphs), for
        the
        rounds queued behind unread ones (width: the readout's top alternatives per row); None: this drafter
        has none here (its next round is launched once the last one is read)."""
        return None

    def replayed(self, graph) -> None:  # noqa: B027 optional hook
        """A round ran as a replay of round_graph's graph (neither propose nor verified was called)."""


class NoDrafter(Drafter):
    """Plain autoregressive decoding: an empty draft, so each round emits exactly the target's next token."""

    name = "none"

    def propose(self, state: DecodeState, k: int) -> Draft:
        return Draft(tokens=torch.zeros(0, dtype=torch.long, device=state.device))
