"""The batched drafter's contract (engine.core.batch decodes B sequences at once): BatchDrafter drafts for
every sequence, BatchDraft carries the ragged drafts; plus the helpers the methods' batched drafters share.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

import torch

from engine.models.batch_runner import BatchRunner
from engine.models.runner import to_device

if TYPE_CHECKING:
    from engine.core.batch import BatchSampler, SequenceResult


# ------------------------------------------------------------------------------------------------ drafts
@dataclass
class BatchDraft:
    tokens: torch.Tensor  # [B, N] int64 on the device (rows past counts[b] are padding)
    counts: List[int]  # real drafts per sequence (0 for finished ones)
    probs: Optional[torch.Tensor] = None  # [B, N, V] float32: what each draft was drawn from; None = one-hot

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])


@dataclass
class BatchSequence:
    """A sequence while it decodes: committed tokens (the last one not yet in the target cache)."""

    tokens: list
    prompt_len: int
    budget: int
    result: SequenceResult
    done: bool = False


class BatchDrafter:
    """Drafts for every sequence at once; `commit` gets each sequence's accepted count. A drafter that reads
    the target's features (EAGLE) gets the prefill's at `start` ([B, P, H], P the longest prompt less one;
    None for one-token prompts) and the round block's at `commit` ([B, N+1, H])."""

    def start(self, seqs: List[BatchSequence], max_length: int,
              features: Optional[torch.Tensor] = None) -> None:
        pass

    def propose(self, seqs: List[BatchSequence], k: int, sampler: "BatchSampler") -> BatchDraft:
        raise NotImplementedError

    def commit(self, seqs: List[BatchSequence], accepted: List[int],
               features: Optional[torch.Tensor] = None) -> None:
        pass


class NoBatchDrafts(BatchDrafter):
    def propose(self, seqs, k, sampler) -> BatchDraft:
        device = sampler.device
        return BatchDraft(torch.zeros(len(seqs), 0, dtype=torch.long, device=device), [0] * len(seqs))


def pad_width(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [B, m, ...] cut or zero-padded to [B, width, ...] along dim 1."""
    m = x.shape[1]
    if m >= width:
        return x[:, :width]
    pad = x.new_zeros((x.shape[0], width - m) + tuple(x.shape[2:]))
    return torch.cat([x, pad], dim=1)


def fits_batch(runner: Optional[BatchRunner], batch: int, max_length: int) -> bool:
    """Whether a batched runner can be kept for B sequences of max_length tokens."""
    return runner is not None and runner.batch == batch and runner.max_length >= max_length


def prefill_batch(runner: BatchRunner, seqs: List[BatchSequence]) -> Optional[torch.Tensor]:
    """Every prompt but its last token (fed by the first round), right-padded into one block; its features
    [B, P, H] (P the longest prompt less one), None when every prompt is one token."""
    prefixes = [s.tokens[:-1] for s in seqs]
    width = max(len(p) for p in prefixes)
    if width == 0:
        return None
    rows = [p + [0] * (width - len(p)) for p in prefixes]
    return runner.forward(to_device(rows, runner.device).view(len(seqs), width), [len(p) for p in prefixes],
                          with_logits=False)[1]


def forward_ragged(runner: BatchRunner, feeds: List[list], device, width: int = 1) -> torch.Tensor:
    """Feed each sequence its own tokens (right-padded to at least `width`: a fixed block size keeps to one
    captured graph); the logits [B, V] after each one's last real token (a sequence fed nothing gets row 0,
    which nobody reads)."""
    width = max(width, max(len(f) for f in feeds))
    rows = [f + [0] * (width - len(f)) for f in feeds]
    logits = runner.forward(to_device(rows, device).view(len(feeds), width), [len(f) for f in feeds])[0]
    last = to_device([max(len(f) - 1, 0) for f in feeds], device)  # [B]
    return logits[torch.arange(len(feeds), device=logits.device), last]  # [B, V]
