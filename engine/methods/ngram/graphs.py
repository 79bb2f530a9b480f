"""n-gram prompt lookup on the device: the lookup with fixed shapes (NgramLookup, the torch twin of
sp_ngram_lookup), the corpus table's fill (corpus_fill) and the replayed greedy round (NgramRoundGraph)."""
from __future__ import annotations

from typing import Optional

import torch

from engine.core.graphs import ChainGraphs, ChainRoundGraph, round_kernels
from engine.kernels.step import (
    NGRAM_MAX_N,
    THREADS,
)
from engine.models.runner import to_device

# n-gram's lookup runs in one kernel (sp_ngram_lookup) where the target has the decode kernels, else in
# NgramLookup's torch operations; in a replayed round the kernel also appends the last round's tokens and
# builds the round's block (sp_chain_block's work): one launch.


class NgramLookup:
    """engine.methods.ngram.drafter.lookup_continuation on the device, with fixed shapes and no loop over
    positions:
    history [M] int64 holds the committed tokens in [0, L) (anything past them), length [1] int64 is L.
    Returns (tokens [k] int64, count [1] int64): the first `count` tokens are the lookup's proposal, the rest
    stray ids. An occurrence is found by where it ends: the last n tokens occur earlier, ending at t, when
    history[t - i] equals the i-th last token for every i < n, a running AND over i for all n at once."""

    def __init__(self, m: int, max_n: int, k: int, device, table=None):
        """table: a CorpusTable on the device, whose continuation fills the slots past the count
        (corpus_fill), or None."""
        self.max_n, self.k, self.table = max_n, k, table
        self.ends = torch.arange(m, device=device)  # [M] where an earlier occurrence may end
        self.back = torch.arange(max_n, device=device)[:, None]  # [N, 1] tokens back from its end
        self.earlier = (self.ends - self.back).clamp_min(0)  # [N, M] the index of history[t - i]
        self.lengths = self.back[:, 0] + 1  # [N] the suffix length n of each row
        self.steps = torch.arange(k, device=device)  # [k]

    def __call__(self, history: torch.Tensor, length: torch.Tensor):
        suffix = history.gather(0, (length - 1 - self.back[:, 0]).clamp_min(0))  # [N] last tokens, last first
        same = (history[self.earlier] == suffix[:, None]).long().cumprod(0)  # [N, M] row n-1: n tokens match
        # it ends before the last token, and it starts at 0 or later (so n <= L - 1 too)
        valid = (self.ends <= length - 2) & (self.ends >= self.back)  # [N, M]
        best = torch.where((same > 0) & valid, self.ends, -1).max(1).values  # [N] its latest end per n
        found = best >= 0
        longest = (found.long() * self.lengths).argmax()  # the row of the longest n that occurs
        # gather, not best[longest]: indexing by a 0-d tensor reads it on the host, which a capture forbids
        begin = best.gather(0, longest.reshape(1)) + 1  # [1] the continuation's first index
        count = torch.where(found.any(), (length - begin).clamp(0, self.k), 0)  # [1]
        index = (begin + self.steps).clamp(0, history.numel() - 1)  # [k]
        tokens = history.index_select(0, index)
        if self.table is None:
            return tokens, count
        return corpus_fill(history, length, tokens, count, self.table)


def corpus_fill(history: torch.Tensor, length: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor,
                table):
    """The lookup's (tokens [k], count [1]) with the slots past count filled by the table's continuation of
    the context (history's first L tokens, then the count tokens), as CorpusTable.continuation does; fixed
    shapes, nothing read on the host. Slots the table does not fill keep their stray tokens."""
    k, m, vocab, width = tokens.numel(), history.numel(), table.vocab, table.width

    def context_token(position: torch.Tensor) -> torch.Tensor:  # [1]: the context's token at position
        from_tokens = position >= length
        drafted = tokens.gather(0, (position - length).clamp(0, k - 1))
        return torch.where(from_tokens, drafted, history.gather(0, position.clamp(0, m - 1)))

    last_at = length + count - 1  # [1]
    last, prev = context_token(last_at), context_token(last_at - 1)
    last_ok = (last_at >= 0) & (last >= 0) & (last < vocab)
    prev_ok = (last_at >= 1) & (prev >= 0) & (prev < vocab)
    row = table.chain[last.clamp(0, vocab - 1)][0]  # [W]
    if table.pair_keys.numel():
        key = prev * vocab + last
        at = torch.searchsorted(table.pair_keys, key).clamp(max=table.pair_keys.numel() - 1)  # [1]
        found = prev_ok & (table.pair_keys.gather(0, at) == key)
        row = torch.where(found, table.pair_tokens[at][0], row)
    filled = ((row >= 0).long().cumprod(0).sum() * last_ok).reshape(1)  # [1] leading real tokens of the row
    slot = torch.arange(k, device=tokens.device) - count  # [k] the row's index for each slot
    use = (slot >= 0) & (slot < filled)
    tokens = torch.where(use, row.gather(0, slot.clamp(0, width - 1)), tokens)
    return tokens, count + torch.minimum(filled, k - count)


def _ngram_lookup(target, m: int, max_n: int, k: int, table=None):
    """(history [m], length [1]) -> (tokens [k], count [1]): sp_ngram_lookup on the target's decode kernels,
    else NgramLookup; table: the CorpusTable that fills what the lookup leaves, or None."""
    kernels = getattr(target, "decode_kernels", None)
    if kernels is not None and max_n <= NGRAM_MAX_N and k <= THREADS:
        return _KernelLookup(kernels, max_n, k, table)
    return NgramLookup(m, max_n, k, target.device, table)


class _KernelLookup:
    """sp_ngram_lookup as NgramLookup's drop-in: (history, length) -> (tokens [k], count [1])."""

    def __init__(self, kernels, max_n: int, k: int, table=None):
        self.kernels, self.max_n, self.k, self.table = kernels, max_n, k, table

    def __call__(self, history: torch.Tensor, length: torch.Tensor):
        return self.kernels.ngram_lookup(history, length, self.max_n, self.k, table=self.table)


def append_emitted(history: torch.Tensor, length: torch.Tensor, chain: torch.Tensor, next_token: torch.Tensor,
                   accepted: torch.Tensor, rows: Optional[torch.Tensor] = None) -> None:
    """A round's emitted tokens (its chain's accepted prefix, then its next token) appended to history [M] at
    length [1], which moves past them, in place; the rows after them get stray tokens (written over later).
    rows: arange(K + 1) on the device, made once by a caller that appends every round. sp_ngram_lookup's
    append (its `emitted`) is the kernel twin."""
    if rows is None:
        rows = torch.arange(chain.numel() + 1, device=history.device)
    emitted = torch.cat((chain, next_token)).scatter(0, accepted, next_token)  # [K+1]
    history.index_copy_(0, length + rows, emitted)
    length.add_(accepted + 1)


def ngram_lookup(history: torch.Tensor, length: torch.Tensor, max_n: int, k: int, table=None):
    """NgramLookup once (for tests and one-off lookups)."""
    return NgramLookup(history.numel(), max_n, k, history.device, table)(history, length)


class NgramRoundGraph(ChainRoundGraph):
    """n-gram prompt lookup (greedy): the committed tokens kept on the device, the last round's accepted ones
    and next token appended, the lookup (NgramLookup) over them; the chain has K slots, and the lookup's
    count of real tokens caps the verification's accepted length and goes out with the readout."""

    counts_drafts = True

    def __init__(self, target, k: int, max_n: int, backend, width: int, table=None):
        """table: the CorpusTable on the target's device that fills what the lookup leaves, or None."""
        self._chain_buffers(target, k)
        device = target.device
        self.history = torch.zeros(target.max_length + k + 2, dtype=torch.long, device=device)  # [M]
        self.length = torch.zeros(1, dtype=torch.long, device=device)  # committed tokens in history
        self.count = torch.zeros(1, dtype=torch.long, device=device)  # real tokens of the chain
        lookup = _ngram_lookup(target, self.history.numel(), max_n, k, table)
        fused = round_kernels(target, backend) if isinstance(lookup, _KernelLookup) else None
        rows = torch.arange(k + 1, device=device)  # [K+1], for the torch append

        def draft():
            last = (self.draft, self.next_token, self.accepted)  # the last round's emitted tokens
            if fused is not None:  # the append, the lookup and the round's block: one launch
                tokens, self.prepared = fused.ngram_block(self.history, self.length, max_n, k, last,
                                                          self.count, self.start, target.embed_weight, table)
                return tokens, None
            append_emitted(self.history, self.length, *last, rows)
            tokens, count = lookup(self.history, self.length)
            self.count.copy_(count)
            return tokens, None

        self._draft = draft
        self._capture_chain(target, backend, width, None)


    def seed(self, launched, drafter) -> None:
        """Take a round launched without the graph: the committed tokens before it (the drafter's view of
        the run's tokens, which that round has not extended yet), its outcome and chain."""
        committed = drafter.committed
        self.history.zero_()
        self.history[:len(committed)].copy_(to_device(committed, self.target.device))
        self.length.fill_(len(committed))
        self._seed_chain(launched)


def ngram_round_graph(target, k: int, max_n: int, backend, width: int,
                      table=None) -> Optional[NgramRoundGraph]:
    """The captured greedy n-gram round at K, built on first use and kept with the target's graphs; None
    where it does not apply (as for Medusa's)."""
    rows = k + 1
    if not (ChainGraphs.available(target, 2) and backend.compiles_kernels and target.decode_path(rows)):
        return None
    if target.length + 1 + k + rows > target.max_length:
        return None
    key = ("ngram_round", k, max_n, width, None if table is None else id(table))
    return ChainGraphs.of(target).get(key, lambda: NgramRoundGraph(target, k, max_n, backend, width, table))
