"""The draft model's batched drafter: K tokens for all B sequences over its own batched cache."""
from __future__ import annotations

from typing import List, Optional

import torch

from engine.methods.batch_base import BatchDraft, BatchDrafter, fits_batch, forward_ragged, prefill_batch
from engine.models.batch_runner import BatchRunner


class DraftModelBatchDrafter(BatchDrafter):
    """The draft model drafts K tokens for all B sequences at once over its own batched cache (mirrors
    engine.methods.draft_model.drafter: feed what the cache lacks, 1 or 2 tokens, then K-1 single steps)."""

    def __init__(self, runner):
        self.runner = runner
        self.batch: Optional[BatchRunner] = None
        self.base: List[int] = []
        self.last_k = 0
        self.use_graphs = runner.device.type == "cuda"

    def start(self, seqs, max_length, features=None) -> None:
        if not fits_batch(self.batch, len(seqs), max_length):
            self.batch = None  # free the old cache first
            self.batch = BatchRunner(self.runner, len(seqs), max_length)
        self.batch.use_graphs = self.use_graphs
        self.batch.reset()
        prefill_batch(self.batch, seqs)

    def propose(self, seqs, k, sampler) -> BatchDraft:
        runner = self.batch
        live = [not s.done for s in seqs]
        feeds = [s.tokens[length:] if ok else []
                 for s, length, ok in zip(seqs, runner.lengths, live, strict=True)]
        self.base, self.last_k = [len(s.tokens) for s in seqs], k
        width = 2 if runner.use_graphs else 1  # a fixed width keeps the first step to one captured graph
        logits = forward_ragged(runner, feeds, sampler.device, width)  # [B, V]: draft token 0's distribution
        tokens, probs = [], []
        ones = [1 if ok else 0 for ok in live]
        for i in range(k):
            token, q = sampler.draw(logits)  # [B], [B, V] or None
            tokens.append(token)
            probs.append(q)
            if i < k - 1:
                logits = runner.forward(token[:, None], ones)[0][:, 0]
        probs_t = None if probs[0] is None else torch.stack(probs, dim=1)  # [B, K, V]
        counts = [k if ok else 0 for ok in live]
        return BatchDraft(torch.stack(tokens, dim=1), counts, probs_t)

    def commit(self, seqs, accepted, features=None) -> None:
        # each cache holds the committed tokens plus drafts 1..K-1 of its row: keep the accepted ones
        keep = self.last_k - 1
        self.batch.lengths = [min(length, base + min(acc, keep)) for length, base, acc
                              in zip(self.batch.lengths, self.base, accepted, strict=True)]
