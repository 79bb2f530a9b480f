"""EAGLE's batched drafter: the head's chain for all B sequences over its own batched cache."""
from __future__ import annotations

from typing import List, Optional

import torch

from engine.methods.batch_base import BatchDraft, BatchDrafter, fits_batch, pad_width
from engine.models.batch_runner import BatchRunner
from engine.models.runner import to_device


class EagleBatchDrafter(BatchDrafter):
    """EAGLE's chain for all B sequences at once (mirrors engine.methods.eagle.drafter.EagleDrafter._chain):
    the
    head's one layer runs over its own batched cache, each sequence at its own length.

    Head row r of sequence b is fc([f_r ; e(x_{r+1})]), f_r the target's feature at position r. `true`
    holds each sequence's rows built from the target's true features; the pending inputs (the prefill's
    features, then each round's accepted rows) are fed at the next propose, ragged, and the head's output at
    each sequence's last fed row starts its chain: K tokens drawn from the head's logits (argmax, or sampled
    with its q), each fed back with its predicted feature. The drafted rows are dropped at commit (each cache
    rolled back to its true rows), like the target's rejected rows."""

    def __init__(self, head):
        self.head = head  # engine.methods.eagle.drafter.EagleHead
        self.batch: Optional[BatchRunner] = None
        self.true: List[int] = []  # head rows from true features, per sequence
        self.pending = None  # (features [B, m, H], next tokens [B, m] on the device, counts [B]) or None
        self.use_graphs = head.runner.device.type == "cuda"

    def start(self, seqs, max_length, features=None) -> None:
        if not fits_batch(self.batch, len(seqs), max_length):
            self.batch = None  # free the old cache first
            self.batch = BatchRunner(self.head.runner, len(seqs), max_length)
        self.batch.use_graphs = self.use_graphs
        self.batch.reset()
        self.true = [0] * len(seqs)
        counts = [len(s.tokens) - 1 for s in seqs]  # features of positions 0..P-2, next tokens 1..P-1
        self.pending = None
        if features is not None and max(counts) > 0:
            width = features.shape[1]
            rows = [s.tokens[1:] + [0] * (width - c) for s, c in zip(seqs, counts, strict=True)]
            self.pending = (features, to_device(rows, features.device).view(len(seqs), width), counts)

    def propose(self, seqs, k, sampler) -> BatchDraft:
        runner, bsz = self.batch, len(seqs)
        runner.set_lengths(self.true)  # drafted rows of the last round are gone
        fed = [0] * bsz
        feature = logits = None
        if self.pending is not None:
            features, next_tokens, fed = self.pending
            fed = [c if not s.done else 0 for c, s in zip(fed, seqs, strict=True)]
            if max(fed) > 0:
                feature, logits = self._feed(features, next_tokens, fed, k)
            self.true = list(runner.lengths)
            self.pending = None
        # a sequence drafts once its head has a row (a one-token prompt waits for its first round)
        drafting = [not s.done and c > 0 for s, c in zip(seqs, fed, strict=True)]
        counts = [k if ok else 0 for ok in drafting]
        if not any(drafting):
            return BatchDraft(torch.zeros(bsz, 0, dtype=torch.long, device=sampler.device), [0] * bsz)
        ones = [1 if ok else 0 for ok in drafting]
        tokens, probs = [], []
        for i in range(k):
            token, q = sampler.draw(logits)  # [B], [B, V] or None
            tokens.append(token)
            probs.append(q)
            if i < k - 1:  # the head shares the target's norm and LM head: its logits are the next ones
                out_logits, hidden = runner.forward_embeds(self.head.fuse(feature, token)[:, None], ones)
                feature, logits = hidden[:, 0], out_logits[:, 0]
        probs_t = None if probs[0] is None else torch.stack(probs, dim=1)  # [B, K, V]
        return BatchDraft(torch.stack(tokens, dim=1), counts, probs_t)

    def _feed(self, features: torch.Tensor, next_tokens: torch.Tensor, counts: List[int], k: int):
        """Append each sequence's pending rows (counts[b] of them, right-padded); the head's predicted
        feature [B, H] and logits [B, V] after each one's last row (row 0 for a sequence fed nothing)."""
        width = max(counts)
        if self.use_graphs and width <= k + 1:
            width = k + 1  # a round feeds 1..K+1 rows: one width keeps to one captured graph
        features, next_tokens = pad_width(features, width), pad_width(next_tokens, width)
        logits, hidden = self.batch.forward_embeds(self.head.fuse(features, next_tokens), counts)
        rows = torch.arange(len(counts), device=hidden.device)
        last = to_device([max(c - 1, 0) for c in counts], hidden.device)  # [B]
        return hidden[rows, last], logits[rows, last]

    def commit(self, seqs, accepted, features=None) -> None:
        # the block's rows 0..a_b (the last committed token and the accepted drafts) hold true features; the
        # tokens after them are the round's emitted ones, the last a_b + 1 of each sequence's tokens
        counts = [0 if s.done else acc + 1 for s, acc in zip(seqs, accepted, strict=True)]
        self.batch.set_lengths(self.true)
        if features is None or max(counts) == 0:
            self.pending = None
            return
        width = features.shape[1]
        rows = [s.tokens[len(s.tokens) - c:] + [0] * (width - c) if c else [0] * width
                for s, c in zip(seqs, counts, strict=True)]
        self.pending = (features, to_device(rows, features.device).view(len(seqs), width), counts)
