"""n-gram's batched drafter: prompt lookup on the host, per sequence (ragged proposals)."""
from __future__ import annotations

from engine.methods.batch_base import BatchDraft, BatchDrafter
from engine.methods.ngram.drafter import lookup_continuation
from engine.models.runner import to_device


class NgramBatchDrafter(BatchDrafter):
    """Prompt lookup on the host, per sequence; proposals are ragged."""

    def __init__(self, max_n: int, table=None):
        self.max_n, self.table = max_n, table  # table: the target's CorpusTable, or None

    def propose(self, seqs, k, sampler) -> BatchDraft:
        proposals = [[] if s.done else lookup_continuation(s.tokens, self.max_n, k, self.table) for s in seqs]
        width = max(len(p) for p in proposals)
        rows = [p + [0] * (width - len(p)) for p in proposals]
        tokens = to_device(rows, sampler.device).view(len(seqs), width)
        return BatchDraft(tokens, [len(p) for p in proposals])
