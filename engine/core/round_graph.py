"""A whole round as one CUDA graph that feeds itself on the device: Medusa's, EAGLE's chain, the draft
model's chain and plain decoding's step.

A round queued behind an unread one (SpeculativeDecoder._launch_after) can need nothing from the host: the
last round's outcome (accepted count, path, next token), what the drafter made of its block (Medusa: the
heads' drafts from every row; EAGLE: the block's features, to feed its head) and the block's start are on the
device. Queued op by op, a Medusa round is some forty launches and copies, and on the shipped pair the host's
share of them took twice a plain round. Captured (greedy, or sampled with the round's uniforms copied in), a
round is one replay (a chain's: two, its drafting first, so that the round's clock times the phases apart):

  Medusa: 1. the last block keeps its accepted path in the target's cache (its rows moved down on the
  device); 2. the new block: the last next token, then the accepted row's tree; 3. the target's step over the
  block (decode path), the tree verification, the event's readout; 4. the heads' drafts from every row of the
  new block.
  EAGLE (a chain of K): 1. the head reads the last block's K+1 rows (features, each row's next token) at its
  true length; the rows past the accepted ones are stray, and the chain, drafted from the last accepted row's
  prediction, writes over them; 2. the block [next token] + chain after the accepted path (a chain keeps its
  prefix in place); 3. as Medusa's.
  The draft model (a chain of K): its forward over two rows after its valid prefix, its chain, then 2. and 3.
  Plain decoding: the last next token's step, its verification (the argmax, or a sample) and the readout.
  Then the outcome, the drafts or features and the new starts become the next replay's inputs (the graph's own
  buffers).

The buffers are seeded from a round that ran without the graph (seed) before the first replay after it.
EAGLE's head reads K+1 rows where a round launched apart reads the accepted ones only, so its products may
round differently there; the verification keeps the output lossless either way.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from engine.core.chain_graph import (
    ChainGraphs,
    eagle_chain_steps,
    graph_pool,
    head_step,
    medusa_proposal,
    medusa_rows_end_in_kernel,
    model_chain_steps,
)
from engine.kernels.step import (
    NGRAM_MAX_N,
    THREADS,
    chain_block_reference,
    chain_commit_reference,
    chain_limit_reference,
    keep_path_reference,
)
from engine.models.runner import fill_unknown, graph_capture, to_device, warm_up_stream

# Sampled chain and plain rounds are replayed too (SPECPLAY_SAMPLED_ROUND_GRAPHS=0 launches them apart). A
# sampled K sweep had stopped on an illegal address on an H200 while kernel scratch was made inside
# captures; with engine.models.runner.capture_stream the same sweep ran to the end
# (docs/measurements/ksweep_gpu_t08_sampled_replays.txt).
SAMPLED_CHAINS = os.environ.get("SPECPLAY_SAMPLED_ROUND_GRAPHS", "1") != "0"
# n-gram's lookup in one kernel (sp_ngram_lookup) where the target has the decode kernels, else
# NgramLookup's torch operations; SPECPLAY_NGRAM_KERNEL=0 keeps the torch ones, for comparisons
NGRAM_KERNEL = os.environ.get("SPECPLAY_NGRAM_KERNEL", "1") != "0"
# a round's bookkeeping (a chain's or Medusa's block: its tokens, start and embeddings; the outcome copied
# into the next replay's inputs; n-gram's cut at its count and its history's append; a tree's accepted path
# kept in the cache) in one kernel each (kernels/round_kernels.cu) where the target has the decode kernels
# and the verification is the CUDA backend's; SPECPLAY_ROUND_KERNELS=0 keeps the torch operations (their
# twins), for comparisons
ROUND_KERNELS = os.environ.get("SPECPLAY_ROUND_KERNELS", "1") != "0"
# Medusa's replayed round drafts the next tree from its block's accepted row only, picked on the device (one
# row through the heads and the LM head); SPECPLAY_MEDUSA_ROW_HEADS=0 drafts from every row of the block and
# picks the accepted row's tree at the next replay's start, for comparisons
ROW_HEADS = os.environ.get("SPECPLAY_MEDUSA_ROW_HEADS", "1") != "0"
# a greedy round's verification, readout and commit launched programmatically behind the kernel before them
# (engine.kernels.pdl: each starts while that one finishes); SPECPLAY_ROUND_PDL=0 launches them the usual way
ROUND_PDL = os.environ.get("SPECPLAY_ROUND_PDL", "1") != "0"
# n-gram's lookup kernel also builds the round's block (sp_chain_block's work, one launch less a round);
# SPECPLAY_NGRAM_BLOCK=0 leaves it to sp_chain_block, for comparisons
NGRAM_BLOCK = os.environ.get("SPECPLAY_NGRAM_BLOCK", "1") != "0"
# a greedy chain round's verification, n-gram's cut and the readout in one launch (backend.greedy_readout;
# plain decoding's argmax and readout too); SPECPLAY_GREEDY_READOUT=0 launches them apart, for comparisons
GREEDY_READOUT = os.environ.get("SPECPLAY_GREEDY_READOUT", "1") != "0"


def ends_in_kernel(target, kernels, rows: int) -> bool:
    """Whether the target's step of `rows` rows ends in a step kernel (its LM head in sp_gemv) where the
    round's kernels run (kernels: round_kernels'), so the verification may start early behind it."""
    return kernels is not None and getattr(target, "step_ends_in_kernel", lambda n: False)(rows)


def chained(programmatic: bool) -> dict:
    """The CUDA backend's launch option, given only where it holds (backends wrapped by the tests take the
    reference's arguments)."""
    return {"chained": True} if programmatic and ROUND_PDL else {}


def round_kernels(target, backend):
    """The target's step kernels where a round's bookkeeping runs on them (see ROUND_KERNELS), else None."""
    kernels = getattr(target, "decode_kernels", None)
    if ROUND_KERNELS and kernels is not None and getattr(backend, "compiles_kernels", False):
        return kernels
    return None


class RoundGraph:
    """A captured round: replay() runs it; its outputs (tokens [N+1] of the block, features, logits,
    result, values: the readout) are static tensors that the next replay overwrites. Subclasses set the
    buffers and `depth` (the longest path a round can accept) and call _capture(round_)."""

    depth: int
    nodes: int
    parents: Optional[torch.Tensor] = None  # [N] host, a tree's; None for a chain
    # the readout ends with the count of the chain's real tokens (SpeculativeDecoder._read_round cuts to it)
    counts_drafts = False

    @property
    def rows(self) -> int:
        return self.nodes + 1

    def _capture(self, target, round_, draft_=None) -> None:
        """Capture round_ on CUDA; elsewhere replay() runs it eagerly (what the CPU tests drive). draft_: the
        round's drafting, captured as a graph of its own that replay_draft() runs first, so that the round's
        clock times drafting and verification apart (round_ reads what draft_ left in self.drafted)."""
        self._round, self._draft_round = round_, draft_  # keeps alive what the graphs read
        device = target.device
        self.fed_by = None  # the launched round whose outcome the buffers hold (see seed)
        self.graph = self.draft_graph = None
        if device.type != "cuda":
            return
        with warm_up_stream(device):
            if draft_ is not None:
                draft_()
            round_()  # warm-up outside the capture (cuBLAS workspaces, lazy kernels)
        if draft_ is not None:  # captured first: its outputs are the round's inputs
            self.draft_graph = torch.cuda.CUDAGraph()
            with graph_capture(self.draft_graph, graph_pool(target), device):
                draft_()
        self.graph = torch.cuda.CUDAGraph()
        with graph_capture(self.graph, graph_pool(target), device):
            self.tokens, self.features, self.logits, self.result, self.values = round_()

    def replay_draft(self, calls=None) -> None:
        """The round's drafting, when it is a graph of its own (chains); then replay() the rest. calls: the
        generation's engine.kernels.cuda_calls.StreamCalls, which launches the graph on its stream (None:
        torch's
        replay on the current stream)."""
        if self._draft_round is None:
            return
        if self.draft_graph is None:
            self._draft_round()
        else:
            _launch(self.draft_graph, calls)

    def replay(self, calls=None) -> None:
        if self.graph is None:
            self.tokens, self.features, self.logits, self.result, self.values = self._round()
        else:
            _launch(self.graph, calls)

    def _seed_outcome(self, launched) -> None:
        self.accepted.copy_(launched.result.accepted[:1])
        self.next_token.copy_(launched.next_token_on_device)
        self.start.fill_(launched.block_start)

    def draw_uniforms(self, state) -> torch.Tensor:
        """A sampled round's uniforms, drawn from the run's generator where a round launched apart draws them
        and copied in; returns the verification's on the host (the event's)."""
        uniforms = torch.rand(self.rows, generator=state.generator)
        self.verify_u.copy_(to_device(uniforms, self.target.device, torch.float32)[None])
        return uniforms


class MedusaRoundGraph(RoundGraph):
    """One Medusa round (greedy or sampled) at a fixed tree (MedusaTree), or at a tree chosen every round
    from fixed candidates (MedusaCandidates): such a round first chooses its tree from the candidates' tokens
    and scores that the last round drafted, and the tree's parents are an output of the graph, copied back
    with the readout."""

    def __init__(self, target, heads, tree, backend, vocab: int, width: int, warp: Optional[tuple] = None):
        """warp: (temperature, top_k, top_p) for sampled rounds (recursive rejection sampling with the
        uniforms copied into `verify_u` before each replay), None for greedy ones."""
        device, n, per_round = target.device, tree.size, tree.per_round
        self.target, self.depth, self.nodes = target, tree.depth, n
        self.per_round = per_round
        # the last round's outcome and drafts, and its block's start: the replay's inputs
        self.accepted = torch.zeros(1, dtype=torch.long, device=device)
        self.path = torch.full((n,), -1, dtype=torch.long, device=device)
        self.next_token = torch.zeros(1, dtype=torch.long, device=device)
        # the next round's drafts (a fixed tree's N tokens, or the T candidates' tokens and scores): from the
        # last block's accepted row only ([1, ...], ROW_HEADS), or from every row of it ([N+1, ...]) with the
        # accepted row picked at the next round's start
        self.row_heads = ROW_HEADS
        shape = (1 if self.row_heads else n + 1, len(tree.paths) if per_round else n)
        self.early = torch.zeros(shape, dtype=torch.long, device=device)
        self.early_scores = torch.zeros(shape, dtype=torch.float32, device=device) if per_round else None
        # a start past the cache's end for the warm-up and the capture: they write only free rows
        self.start = torch.full((1,), target.length, dtype=torch.long, device=device)
        self.verify_u = torch.zeros(1, n + 1, dtype=torch.float32, device=device)  # [1, N+1], sampled rounds
        if not per_round:
            self.parents = torch.tensor(tree.parents, dtype=torch.long)  # [N] host, for the events
            fixed_tree = (self.parents.to(device),  # [N]
                          *target._tree_block(torch.cat((torch.tensor([-1]), self.parents + 1))))
        kv = _kv(target, n + 1)
        minus_one = torch.full((1,), -1, dtype=torch.long, device=device)
        rows = target._arange[:self.depth]  # [D]
        # the block from the last outcome, and the new outcome into the next replay's inputs, as a chain's
        kernels = round_kernels(target, backend)
        block = chain_block_reference if kernels is None else kernels.chain_block
        commit = chain_commit_reference if kernels is None else kernels.chain_commit

        if self.row_heads and kernels is not None and keeps_path_in_kernel(target, self.path[:self.depth]):
            # the block's kernel starts early behind the kept path's (both kernels, no copy between)
            block = functools.partial(kernels.chain_block, chained=True)
        pdl = chained(ends_in_kernel(target, kernels, n + 1) and warp is None)  # greedy: verify, readout

        def round_():
            if per_round:  # the tree first: the block's kernel follows the kept path's
                drafts, tree_parents, block_depth, block_visible = tree.choose(*self._drafted_row())
                self.parents = tree_parents  # [N] on the device, the event's (copied back with the readout)
            else:
                (drafts,), (tree_parents, block_depth, block_visible) = self._drafted_row(), fixed_tree
            keep_path(target, self.start, self.path[:self.depth], rows)
            # tokens [N+1] = [next token, drafts], start [1] = the last start + 1 + accepted, x [N+1, H]
            tokens, start, x = block(self.next_token, drafts, self.start, self.accepted, target.embed_weight)
            hidden, logits = target._block_step(x, start, block_depth, block_visible, kv,
                                                after_step_kernel=kernels is not None)  # [N+1, H], [N+1, V]
            if warp is None:
                result = backend.verify_tree_greedy(logits[None], tokens[None, 1:], tree_parents, **pdl)
            else:  # one-hot q: Medusa's tokens are its heads' top ranks
                result = backend.verify_tree_stochastic(logits[None], tokens[None, 1:], tree_parents, None,
                                                        self.verify_u, *warp)
            temperature = 1.0 if warp is None else warp[0]
            values = backend.readout(logits, result, tokens[1:], temperature, width, **pdl)
            # (the readout's is a kernel: the heads' may start behind it)
            # a chosen tree's candidates' scores straight into the next round's input
            scores_out = self.early_scores if per_round else None
            if self.row_heads:  # the heads on the row that gave the next token, picked on the device
                early = medusa_proposal(target, heads, hidden, tree, vocab, result.accepted[:1],
                                        result.path[0], chained=True, scores_out=scores_out)  # [1, ...]
            else:
                early = medusa_proposal(target, heads, hidden, tree, vocab, chained=True,
                                        scores_out=scores_out)  # [N+1, ...]
            early_tokens = early[0] if per_round else early
            # accepted (>= 0: -1 flags NaN, which the readout raises), next token, drafts, start and path
            behind_topk = kernels is not None and medusa_rows_end_in_kernel(target, hidden, tree,
                                                                            len(early_tokens))
            commit(result.accepted, result.next_token, early_tokens.view(-1), start, self.accepted,
                   self.next_token, self.early.view(-1), self.start, path_in=result.path[0], path=self.path,
                   **chained(behind_topk))
            return tokens, hidden, logits, result, values

        self._minus_one = minus_one
        self._capture(target, round_)

    @property
    def proposal(self):
        """The drafts of the last replay's block (the Medusa drafter's early): the tokens, or the candidates'
        tokens and scores."""
        return (self.early, self.early_scores) if self.per_round else self.early

    def _drafted_row(self) -> tuple:
        """(drafts [N],) or (candidate tokens [T], scores [T]): what the last block's accepted row drafted."""
        buffers = (self.early, self.early_scores) if self.per_round else (self.early,)
        if self.row_heads:
            return tuple(b[0] for b in buffers)
        row = self._accepted_row()
        return tuple(b.index_select(0, row)[0] for b in buffers)

    def _accepted_row(self) -> torch.Tensor:
        """[1] the last block's row whose distribution gave its next token: its accepted path's last node's
        row, 0 when nothing was accepted (read from the outcome buffers, on the device)."""
        path = torch.cat((self._minus_one, self.path))  # [N+1]
        return path.index_select(0, self.accepted) + 1

    def seed(self, launched, drafter) -> None:
        """Take a round launched without the graph as the next replay's last round: its outcome (device),
        the drafts from its rows (the Medusa drafter's early [rows, ...]) and its block's start."""
        self._seed_outcome(launched)
        self.accepted.clamp_(min=0)
        if launched.result.path.shape[-1] == self.nodes:
            self.path.copy_(launched.result.path[0])
        else:  # an empty draft: nothing to keep
            self.path.fill_(-1)
        drafted = drafter.early if self.per_round else (drafter.early,)
        buffers = (self.early, self.early_scores) if self.per_round else (self.early,)
        for buffer, rows in zip(buffers, drafted):
            if self.row_heads:
                buffer.copy_(rows.index_select(0, self._accepted_row()))
            else:
                buffer[:rows.shape[0]].copy_(rows)


class ChainRoundGraph(RoundGraph):
    """A chain drafter's round of K, greedy or sampled (sampling: the run's ChainSampling; the draft's
    uniforms and the verification's copied in before each replay). Subclasses set up their drafter's
    buffers and give _draft(), which returns the chain (tokens [K], q [K, V] or None) from the last round's
    outcome, and _advance(), which moves their buffers on; the target's block, its verification and the
    readout are here."""

    count: Optional[torch.Tensor] = None  # [1]: how many of the chain's K tokens are real drafts (n-gram)
    # the block (tokens [K+1], start [1], x [K+1, H]) the drafting already built (n-gram's lookup kernel), or
    # None: the round builds it from the chain
    prepared: Optional[tuple] = None

    def _chain_buffers(self, target, k: int) -> None:
        device = target.device
        self.target, self.depth, self.nodes = target, k, k
        self.accepted = torch.zeros(1, dtype=torch.long, device=device)
        self.next_token = torch.zeros(1, dtype=torch.long, device=device)
        self.draft = torch.zeros(k, dtype=torch.long, device=device)  # the last block's chain
        # a start past the cache's end for the warm-up and the capture: they write only free rows
        self.start = torch.full((1,), target.length, dtype=torch.long, device=device)
        self.draft_u = torch.zeros(k, dtype=torch.float32, device=device)
        self.verify_u = torch.zeros(1, k + 1, dtype=torch.float32, device=device)

    def _capture_chain(self, target, backend, width: int, sampling) -> None:
        k = self.nodes
        depth, visible = target._chain_block(k + 1)
        kv = _kv(target, k + 1)
        kernels = self.kernels = round_kernels(target, backend)
        block = chain_block_reference if kernels is None else kernels.chain_block
        commit = chain_commit_reference if kernels is None else kernels.chain_commit
        # programmatic launches behind kernels of ours: the greedy verification behind the step's LM head
        # (n-gram's cut and the readout behind it); the commit behind the readout where _advance queues
        # nothing
        verify_pdl = ends_in_kernel(target, kernels, k + 1) and sampling is None and k > 0
        readout_pdl = ends_in_kernel(target, kernels, k + 1)  # greedy_readout: plain decoding's too
        commit_pdl = kernels is not None and type(self)._advance is ChainRoundGraph._advance

        def draft_():
            self.drafted = self._draft()  # [K], [K, V] or None

        if k == 0:  # plain decoding: nothing to draft, no graph of its own
            draft_()

        def round_():
            chain, q = self.drafted
            # the block after the accepted prefix: [next token] + chain [K+1], its start [1], x [K+1, H]
            prepared = self.prepared
            if prepared is None:
                embed = target.embed_weight
                tokens, start, x = block(self.next_token, chain, self.start, self.accepted, embed)
            else:
                tokens, start, x = prepared
            # (the first product starts early behind the block's kernel, where the round has one)
            hidden, logits = target._block_step(x, start, depth, visible, kv,
                                                after_step_kernel=kernels is not None and prepared is None)
            features = target.last_taps if target.tap_layers else hidden
            count = self.count  # n-gram's real drafts (the readout's last value, the commit's), or None
            if sampling is None and GREEDY_READOUT:
                result, values = backend.greedy_readout(logits, chain, width, limit=count,
                                                        extra=int(count is not None), **chained(readout_pdl))
            else:
                if sampling is None:
                    verified = backend.verify_chain_greedy(logits[None], chain[None], **chained(verify_pdl))
                    result = self._limit(verified, chain)
                else:
                    q = None if q is None else q[None]  # None: plain decoding's empty chain
                    result = backend.verify_chain_stochastic(logits[None], chain[None], q, self.verify_u,
                                                             *sampling.key)
                temperature = 1.0 if sampling is None else sampling.key[0]
                values = backend.readout(logits, result, chain, temperature, width,
                                         extra=int(count is not None), **chained(verify_pdl))
            self._advance(features)
            commit(result.accepted, result.next_token, chain, start, self.accepted, self.next_token,
                   self.draft, self.start, count, None if count is None else values[-1:],
                   **chained(commit_pdl))
            return tokens, features, logits, result, values

        self._capture(target, round_, draft_ if k else None)

    def _advance(self, features: torch.Tensor) -> None:
        """The drafter's buffers for the next replay, before the outcome's are overwritten."""

    def _limit(self, result, chain: torch.Tensor):
        """A greedy verification's result, for a chain whose tail may not be real drafts (n-gram)."""
        return result

    def _seed_chain(self, launched) -> None:
        self._seed_outcome(launched)
        drafted = launched.draft.tokens
        self.draft[:drafted.numel()].copy_(drafted)

    def draw_uniforms(self, state) -> torch.Tensor:
        self.draft_u.copy_(state.uniforms(self.nodes))  # drawn first, as a round's propose draws them
        return super().draw_uniforms(state)


class PlainRoundGraph(ChainRoundGraph):
    """Plain decoding's step (an empty chain): the last next token at the next row, the target's step, the
    verification of nothing (the next token: the argmax, or a sample with the round's uniform) and the
    readout. Launched apart, a plain round costs the host more than a chain's replay does."""

    def __init__(self, target, backend, width: int, sampling=None):
        self._chain_buffers(target, 0)
        empty = self.draft  # [0]

        self._draft = lambda: (empty, None)
        self._capture_chain(target, backend, width, sampling)

    def seed(self, launched, drafter) -> None:
        self._seed_outcome(launched)

    def draw_uniforms(self, state) -> torch.Tensor:
        return RoundGraph.draw_uniforms(self, state)  # the verification's one uniform, as _verify draws it


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
    if NGRAM_KERNEL and kernels is not None and max_n <= NGRAM_MAX_N and k <= THREADS:
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
            if fused is not None and NGRAM_BLOCK:  # the append, the lookup and the round's block: one launch
                tokens, self.prepared = fused.ngram_block(self.history, self.length, max_n, k, last,
                                                          self.count, self.start, target.embed_weight, table)
                return tokens, None
            if fused is not None:  # the append and the lookup in one launch
                return fused.ngram_lookup(self.history, self.length, max_n, k, emitted=last,
                                          count=self.count, table=table)[0], None
            append_emitted(self.history, self.length, *last, rows)
            tokens, count = lookup(self.history, self.length)
            self.count.copy_(count)
            return tokens, None

        self._draft = draft
        self._capture_chain(target, backend, width, None)

    def _limit(self, result, chain: torch.Tensor):
        """Accepted no further than the lookup's count (chain_limit_reference, or its kernel in place)."""
        if self.kernels is not None:  # behind the verification's kernel
            return self.kernels.chain_limit(result, chain, self.count, chained=True)
        return chain_limit_reference(result, chain, self.count)

    def seed(self, launched, drafter) -> None:
        """Take a round launched without the graph: the committed tokens before it (the drafter's view of
        the run's tokens, which that round has not extended yet), its outcome and chain."""
        committed = drafter.committed
        self.history.zero_()
        self.history[:len(committed)].copy_(to_device(committed, self.target.device))
        self.length.fill_(len(committed))
        self._seed_chain(launched)


class EagleRoundGraph(ChainRoundGraph):
    """EAGLE's (or EAGLE-3's) chain: the head reads the last block's K+1 rows at its true length (the rows
    past the accepted ones are stray; the chain, drafted from the last accepted row's prediction, writes
    over them)."""

    def __init__(self, target, head, k: int, backend, vocab: int, width: int, sampling=None):
        self._chain_buffers(target, k)
        taps = len(target.tap_layers) or 1
        # the last block's features (the tap layers' side by side for EAGLE-3) [K+1, F]
        self.block_features = torch.zeros(k + 1, taps * target.spec.hidden_size, dtype=target.dtype,
                                          device=target.device)
        self.head_start = torch.full((1,), head.runner.length, dtype=torch.long, device=target.device)
        head_kv = _kv(head.runner, k + 1)

        def draft():
            accepted = self.accepted
            # row i's next token: the chain's token i while accepted, the next token at the last accepted row
            feed = torch.cat((self.draft, self.next_token)).scatter(0, accepted, self.next_token)  # [K+1]
            predicted, logits = head_step(head, self.block_features, feed, self.head_start, head_kv,
                                          with_logits=True)  # [K+1, H], [K+1, V]
            root = predicted.index_select(0, accepted)  # [1, H]: the last accepted row's prediction
            return eagle_chain_steps(head, root, self.head_start + 1 + accepted, k, head_kv, vocab, sampling,
                                     self.draft_u, logits.index_select(0, accepted))

        self._draft = draft
        self._capture_chain(target, backend, width, sampling)

    def _advance(self, features: torch.Tensor) -> None:
        self.head_start.copy_(self.head_start + 1 + self.accepted)  # the head read the accepted rows
        self.block_features.copy_(features)

    def seed(self, launched, drafter) -> None:
        """Take a round launched without the graph as the next replay's last round: its outcome, chain and
        features (device), its block's start and the head's true length (the drafter's)."""
        self._seed_chain(launched)
        self.block_features[:launched.features.shape[0]].copy_(launched.features)
        self.head_start.fill_(drafter.true_length)


class EagleTreeRoundGraph(RoundGraph):
    """EAGLE's (or EAGLE-3's) dynamic tree of N nodes grown D deep, greedy: 1. the last block keeps its
    accepted path in the target's cache (keep_path); 2. the head reads the last block's root and path rows
    (D+1 rows at its true length; the rows past the accepted ones are stray, and the tree's nodes are written
    over them) and grows the next tree from the last accepted row's prediction (the growth of the rounds
    launched apart, at a true length known on the device only); 3. the block [next token] + the tree, the
    tree verification, the readout. The tree's parents are an output of the graph, copied back with the
    readout."""

    def __init__(self, target, head, depth: int, nodes: int, backend, vocab: int, width: int, grow,
                 candidates: int):
        """grow: the drafter's tree growth (engine.methods.eagle.drafter._grow_tree), candidates: the nodes
        it grows
        at this depth (a shallow tree keeps fewer than `nodes`)."""
        device, nodes = target.device, min(nodes, candidates)
        self.target, self.depth, self.nodes = target, depth, nodes
        self.accepted = torch.zeros(1, dtype=torch.long, device=device)
        self.path = torch.full((depth,), -1, dtype=torch.long, device=device)  # [D] the last accepted path
        self.next_token = torch.zeros(1, dtype=torch.long, device=device)
        self.drafted = torch.zeros(nodes, dtype=torch.long, device=device)  # [N] the last tree's tokens
        # a start past the cache's end for the warm-up and the capture: they write only free rows
        self.start = torch.full((1,), target.length, dtype=torch.long, device=device)
        self.head_start = torch.full((1,), head.runner.length, dtype=torch.long, device=device)
        taps = len(target.tap_layers) or 1
        self.block_features = torch.zeros(nodes + 1, taps * target.spec.hidden_size, dtype=target.dtype,
                                          device=device)  # [N+1, F] the last block's
        head_kv, grow_kv, kv = _kv(head.runner, depth + 1), head.runner.max_length, _kv(target, nodes + 1)
        rows = target._arange[:depth]  # [D]
        root_row = torch.zeros(1, dtype=torch.long, device=device)

        def round_():
            keep_path(target, self.start, self.path, rows)
            committed = torch.cat((root_row, self.path + 1)).clamp_min(0)  # [D+1] block rows, stray past a
            # each committed row's next token: the next accepted node's, then the next token
            feed = torch.cat((self.drafted.index_select(0, self.path.clamp_min(0)), self.next_token))
            feed = feed.scatter(0, self.accepted, self.next_token)  # [D+1]
            predicted = head_step(head, self.block_features.index_select(0, committed), feed, self.head_start,
                                  head_kv)  # [D+1, H]
            root = predicted.index_select(0, self.accepted)  # [1, H]: the last accepted row's prediction
            true_length = self.head_start + 1 + self.accepted  # [1]
            tree, parents, block_depth, block_visible = grow(head, root, depth, vocab, true_length, grow_kv,
                                                             nodes)
            tokens = torch.cat((self.next_token, tree))  # [N+1]
            start = self.start + 1 + self.accepted  # [1]
            hidden, logits = target._block_step(F.embedding(tokens, target.embed_weight), start, block_depth,
                                                block_visible, kv)  # [N+1, H], [N+1, V]
            features = target.last_taps if target.tap_layers else hidden
            result = backend.verify_tree_greedy(logits[None], tree[None], parents)
            values = backend.readout(logits, result, tree, 1.0, width)
            self.head_start.copy_(true_length)
            self.block_features.copy_(features)
            self.accepted.copy_(result.accepted[:1])
            self.path.copy_(result.path[0, :depth])
            self.next_token.copy_(result.next_token[:1].clamp_min(0))  # -1 flags NaN: the readout raises
            self.drafted.copy_(tree)
            self.start.copy_(start)
            self.parents = parents  # [N] on the device, the event's (copied back with the readout)
            return tokens, features, logits, result, values

        self._capture(target, round_)

    def seed(self, launched, drafter) -> None:
        """Take a tree round launched without the graph: its outcome, path, tree and features (device), its
        block's start and the head's true length (the drafter's)."""
        self._seed_outcome(launched)
        self.path.copy_(launched.result.path[0, :self.depth])
        self.drafted.copy_(launched.draft.tokens)
        self.block_features[:launched.features.shape[0]].copy_(launched.features)
        self.head_start.fill_(drafter.true_length)


class DraftModelRoundGraph(ChainRoundGraph):
    """The draft model's chain. Its cache holds the committed tokens and the last chain's first K-1 tokens, so
    after `accepted` of them it lacks one token (the next one) or, all K accepted, two (the chain's last and
    the next one): it reads two rows at base + min(accepted, K-1), the second stray when it lacks one, and
    the chain starts from the last real row's logits and writes over the stray one."""

    def __init__(self, runner, target, k: int, backend, vocab: int, width: int, sampling=None):
        self._chain_buffers(target, k)
        # committed tokens when the last chain was drafted: the draft cache's rows before that chain
        self.base = torch.full((1,), runner.length, dtype=torch.long, device=target.device)
        depth, visible = runner._chain_block(2)
        draft_kv = _kv(runner, 2)

        def draft():
            accepted = self.accepted
            whole = (accepted == k).long()  # [1]: 1 when the chain's last token is not in the cache
            row = self.base + accepted - whole  # [1]: base + min(accepted, K - 1)
            last = self.draft[k - 1:]  # [1]
            feed = torch.cat((torch.where(whole > 0, last, self.next_token), self.next_token))  # [2]
            feed = fill_unknown(feed, runner.vocab_size, runner.input_fill)
            _, logits = runner._block_step(F.embedding(feed, runner.embed_weight), row, depth, visible,
                                           draft_kv)  # [2, V]
            first = logits.index_select(0, whole)  # [1, V]: the next token's row
            return model_chain_steps(runner, first, row + 1 + whole, k, draft_kv, vocab, sampling,
                                     self.draft_u)

        self._draft = draft
        self._capture_chain(target, backend, width, sampling)

    def _advance(self, features: torch.Tensor) -> None:
        self.base.copy_(self.base + 1 + self.accepted)  # every token the last round emitted is committed

    def seed(self, launched, drafter) -> None:
        """Take a round launched without the graph: its outcome and chain (device), its block's start and the
        committed count when its chain was drafted (the drafter's base)."""
        self._seed_chain(launched)
        self.base.fill_(drafter.base)


class LayerSkipRoundGraph(ChainRoundGraph):
    """Layer skip's chain: its draft runner is the target's first L layers over the target's own cache, in
    which the last verification left every committed token's rows but the next token's. So the drafting feeds
    the next token at the row after the accepted ones (the block's start + 1 + accepted) and draws the chain
    from there; the target's block then writes over the same rows with all its layers."""

    def __init__(self, runner, target, k: int, backend, vocab: int, width: int, sampling=None):
        self._chain_buffers(target, k)
        depth, visible = runner._chain_block(1)
        draft_kv = _kv(runner, 1)

        def draft():
            row = self.start + 1 + self.accepted  # [1]: the next token's row
            feed = fill_unknown(self.next_token, runner.vocab_size, runner.input_fill)  # [1]
            _, logits = runner._block_step(F.embedding(feed, runner.embed_weight), row, depth, visible,
                                           draft_kv)  # [1, V]
            return model_chain_steps(runner, logits, row + 1, k, draft_kv, vocab, sampling, self.draft_u)

        self._draft = draft
        self._capture_chain(target, backend, width, sampling)

    def seed(self, launched, drafter) -> None:
        """Take a round launched without the graph: its outcome, chain and block start (the cache is the
        target's, so there is nothing of the drafter's own to take)."""
        self._seed_chain(launched)


class HostTreeRoundGraph(RoundGraph):
    """The verification of a tree drafted on the host (suffix decoding, lookahead) with a fixed node count
    (0: an empty draft), as one replay. The host knows the whole block once it has drafted: the block's
    start, its tokens (the last committed one, then the tree's), the tree's parents, depths and ancestor
    mask, and a sampled round's uniforms go to the device in one copy (upload); the target's step, the tree
    verification, the readout and the cache's compaction to the accepted path (keep_path) run captured.
    Queued op by op, this round's host work is several times the GPU's (some forty torch calls, each
    tree shape's masks built and copied, a pageable copy of the parents). The outputs are static: the next
    replay overwrites them, so a host tree is one round in flight (its next draft needs this outcome
    anyway)."""

    RING = 4  # pinned upload buffers, handed out in turn (a buffer comes back after its round was read)

    def __init__(self, target, nodes: int, backend, width: int, warp: Optional[tuple] = None):
        """warp: (temperature, top_k, top_p) for sampled rounds (one-hot q: the host's drafts are
        deterministic), None for greedy ones."""
        device, n, rows = target.device, nodes, nodes + 1
        self.target, self.nodes, self.depth = target, n, n  # depth: the longest path a round can accept
        self.width = width  # the readout's top alternatives per row
        self._ints = 3 * n + 3  # [start, tokens (N+1), parents (N), depths (N+1)] int64
        ints_bytes, floats_bytes = 8 * self._ints, 4 * rows
        size = -(-(ints_bytes + floats_bytes + rows * rows) // 8) * 8
        self.upload_bytes = torch.zeros(size, dtype=torch.uint8, device=device)
        ints = self.upload_bytes[:ints_bytes].view(torch.int64)
        start, tokens = ints[:1], ints[1:1 + rows]  # [1], [N+1]
        parents, block_depth = ints[1 + rows:1 + rows + n], ints[1 + rows + n:]  # [N], [N+1]
        floats = self.upload_bytes[ints_bytes:ints_bytes + floats_bytes]
        uniforms = floats.view(torch.float32)[None]  # [1, N+1]
        mask_at = ints_bytes + floats_bytes
        visible = self.upload_bytes[mask_at:mask_at + rows * rows].view(torch.bool).view(rows, rows)
        # the warm-up and the capture run a chain at the cache's end: only free rows are written
        start.fill_(target.length)
        block_depth.copy_(target._arange[:rows])
        parents.copy_(target._arange[:n] - 1)
        visible.copy_(torch.ones(rows, rows, dtype=torch.bool, device=device).tril())
        self._host = [torch.zeros(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
                      for _ in range(self.RING)]
        self._views = [_upload_views(buffer, self._ints, rows) for buffer in self._host]
        self._turn = 0
        kv = _kv(target, rows)
        node_rows = target._arange[:n]  # [N]
        # greedy: the verification behind the step's LM head, the readout behind it, programmatic launches
        pdl = chained(ends_in_kernel(target, round_kernels(target, backend), rows) and warp is None and n > 0)

        def round_():
            x = F.embedding(fill_unknown(tokens, target.vocab_size, target.input_fill), target.embed_weight)
            hidden, logits = target._block_step(x, start, block_depth, visible, kv)  # [N+1, H], [N+1, V]
            if warp is None:
                result = backend.verify_tree_greedy(logits[None], tokens[None, 1:], parents, **pdl)
            else:
                result = backend.verify_tree_stochastic(logits[None], tokens[None, 1:], parents, None,
                                                        uniforms, *warp)
            temperature = 1.0 if warp is None else warp[0]
            values = backend.readout(logits, result, tokens[1:], temperature, width, **pdl)
            if n:  # the accepted path moves down behind the last committed token (the decoder rolls back)
                keep_path(target, start, result.path[0], node_rows)
            return tokens, hidden, logits, result, values

        self._capture(target, round_)

    def upload(self, calls, start: int, last_token: int, tokens: list, parents: list, uniforms=None) -> None:
        """Queue the round's inputs: the block at cache row start, [last_token] + tokens, the tree's parents
        (-1 = the last committed token, topological order) and a sampled round's uniforms [N+1]."""
        n = self.nodes
        if len(tokens) != n or len(parents) != n:
            raise ValueError(f"a tree of {n} nodes needs {n} tokens and parents, got {len(tokens)}, "
                             f"{len(parents)}")
        block_depth, visible = _tree_shape(tuple(parents))
        host = self._host[self._turn]
        ints, floats, mask = self._views[self._turn]
        self._turn = (self._turn + 1) % self.RING
        ints[0], ints[1] = start, last_token
        ints[2:2 + n] = tokens
        ints[2 + n:2 + 2 * n] = parents
        ints[2 + 2 * n:] = block_depth
        mask[:] = visible
        if uniforms is not None:
            floats[:] = uniforms.numpy()
        if calls is None:
            self.upload_bytes.copy_(host, non_blocking=True)
        else:
            calls.copy_to_device(self.upload_bytes, host)


def _upload_views(buffer: torch.Tensor, ints: int, rows: int) -> tuple:
    """numpy views of a pinned upload buffer: (int64 [ints], float32 [rows], uint8 [rows * rows])."""
    array = buffer.numpy()
    floats_at, mask_at = 8 * ints, 8 * ints + 4 * rows
    return (array[:floats_at].view("int64"), array[floats_at:mask_at].view("float32"),
            array[mask_at:mask_at + rows * rows])


@functools.lru_cache(maxsize=1024)
def _tree_shape(parents: tuple) -> tuple:
    """A host tree's verification block (row 0 the last committed token, row i + 1 node i): (depths
    [N+1], ancestor-or-self mask [(N+1) * (N+1)] as 0/1 bytes, row-major). Tree shapes repeat: each is built
    once."""
    rows = len(parents) + 1
    depths, seen = [0], [{0}]
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"tree parents must be topologically ordered (-1 <= parents[i] < i); "
                             f"parents[{i}] = {parent}")
        depths.append(depths[parent + 1] + 1)
        seen.append(seen[parent + 1] | {i + 1})
    mask = np.array([j in row for row in seen for j in range(rows)], dtype=np.uint8)
    return np.array(depths, dtype=np.int64), mask


def _launch(graph, calls) -> None:
    if calls is None:
        graph.replay()
    else:
        calls.launch(graph)


def _kv(runner, rows: int) -> int:
    """The attention width a round's step of `rows` rows is built for: 0 on the decode path (it reads the
    block's start on the device), else the whole cache (the mask hides what lies past the block)."""
    return 0 if runner._decode_path(rows) else runner.max_length


def keeps_path_in_kernel(target, path: torch.Tensor) -> bool:
    """Whether keep_path moves this path in sp_keep_path."""
    kernels = getattr(target, "decode_kernels", None)
    return ROUND_KERNELS and kernels is not None and kernels.takes_path(target.kv, path)


def keep_path(target, start: torch.Tensor, path: torch.Tensor, rows: torch.Tensor) -> None:
    """The tree block at cache row start (device [1]; its row 0 the last committed token) keeps its accepted
    path: rows start+1+i take rows start+1+path[i] (path [D], -1 past the accepted count; rows = arange(D)).
    sp_keep_path where the target has the decode kernels (see ROUND_KERNELS), else keep_path_reference."""
    if keeps_path_in_kernel(target, path):
        target.decode_kernels.keep_path(target.kv, start, path)
    else:
        keep_path_reference(target.kv, start, path, rows)


def plain_round_graph(target, backend, width: int, sampling=None) -> Optional[PlainRoundGraph]:
    """Plain decoding's captured step, built on first use and kept with the target's graphs; None where it
    does not apply (as for Medusa's)."""
    applies = ChainGraphs.available(target, 2, sampling) and backend.compiles_kernels
    if not (applies and target._decode_path(1)) or (sampling is not None and not SAMPLED_CHAINS):
        return None
    if target.length + 2 > target.max_length:
        return None
    key = ("plain_round", width, None if sampling is None else sampling.key)
    return ChainGraphs.of(target).get(key, lambda: PlainRoundGraph(target, backend, width, sampling))


def ngram_round_graph(target, k: int, max_n: int, backend, width: int,
                      table=None) -> Optional[NgramRoundGraph]:
    """The captured greedy n-gram round at K, built on first use and kept with the target's graphs; None
    where it does not apply (as for Medusa's)."""
    rows = k + 1
    if not (ChainGraphs.available(target, 2) and backend.compiles_kernels and target._decode_path(rows)):
        return None
    if target.length + 1 + k + rows > target.max_length:
        return None
    key = ("ngram_round", k, max_n, width, None if table is None else id(table))
    return ChainGraphs.of(target).get(key, lambda: NgramRoundGraph(target, k, max_n, backend, width, table))


def medusa_round_graph(target, heads, tree, backend, vocab: int, width: int,
                       warp: Optional[tuple] = None) -> Optional[MedusaRoundGraph]:
    """The captured round for this tree, built on first use and kept with the target's graphs; None where it
    does not apply: no graphs, no decode path for the block, no compiled kernels, or too little free cache
    for the capture's rows."""
    n = tree.size + 1
    if not (ChainGraphs.available(target, 2) and backend.compiles_kernels and target._decode_path(n)):
        return None
    if target.length + 1 + tree.depth + n > target.max_length:
        return None
    key = ("medusa_round", id(heads), tree, vocab, width, warp)
    return ChainGraphs.of(target).get(
        key, lambda: MedusaRoundGraph(target, heads, tree, backend, vocab, width, warp))


def eagle_round_graph(target, head, k: int, backend, vocab: int, width: int,
                      sampling=None) -> Optional[EagleRoundGraph]:
    """The captured chain round at K for this head, built on first use and kept with the target's graphs;
    None where it does not apply (as for Medusa's, and the head's step must be on its decode path too)."""
    rows = k + 1
    if not (ChainGraphs.available(target, 2) and backend.compiles_kernels and target._decode_path(rows)
            and head.runner._decode_path(rows)) or (sampling is not None and not SAMPLED_CHAINS):
        return None
    if target.length + 1 + k + rows > target.max_length:
        return None
    if head.runner.length + 2 * rows > head.runner.max_length:
        return None
    key = ("eagle_round", id(head), k, vocab, width, None if sampling is None else sampling.key)
    return ChainGraphs.of(target).get(key, lambda: EagleRoundGraph(target, head, k, backend, vocab, width,
                                                                   sampling))


def eagle_tree_round_graph(target, head, depth: int, nodes: int, backend, vocab: int, width: int, grow,
                           candidates: int) -> Optional[EagleTreeRoundGraph]:
    """The captured greedy tree round for this head, built on first use and kept with the target's graphs;
    None where it does not apply (as for Medusa's, and the head's step must be on its decode path too).
    grow, candidates: as EagleTreeRoundGraph's (the growth's rows in the head's cache)."""
    rows = min(nodes, candidates) + 1
    if not (ChainGraphs.available(target, 2) and backend.compiles_kernels and target._decode_path(rows)
            and head.runner._decode_path(depth + 1) and ChainGraphs.available(head.runner, 2)):
        return None
    if target.length + 1 + depth + rows > target.max_length:
        return None
    if head.runner.length + 2 * (depth + 1) + candidates > head.runner.max_length:
        return None
    key = ("eagle_tree_round", id(head), depth, nodes, vocab, width)
    return ChainGraphs.of(target).get(
        key, lambda: EagleTreeRoundGraph(target, head, depth, nodes, backend, vocab, width, grow, candidates))


def _model_round_applies(runner, target, k: int, backend, runner_rows: int, sampling) -> bool:
    """Whether a chain round at K drafted by a model runner (stepping runner_rows rows first) is captured:
    graphs and compiled kernels, the decode path for both blocks, and free cache rows for the capture."""
    rows = k + 1
    return (ChainGraphs.available(target, 2) and backend.compiles_kernels and target._decode_path(rows)
            and runner._decode_path(runner_rows) and ChainGraphs.available(runner, 2)
            and (sampling is None or SAMPLED_CHAINS) and target.length + 1 + k + rows <= target.max_length)


def layer_skip_round_graph(runner, target, k: int, backend, vocab: int, width: int,
                           sampling=None) -> Optional[LayerSkipRoundGraph]:
    """The captured chain round at K for this layer-skip runner, as eagle_round_graph's."""
    if not _model_round_applies(runner, target, k, backend, 1, sampling):
        return None
    key = ("layerskip_round", id(runner), k, vocab, width, None if sampling is None else sampling.key)
    return ChainGraphs.of(target).get(
        key, lambda: LayerSkipRoundGraph(runner, target, k, backend, vocab, width, sampling))


def draft_model_round_graph(runner, target, k: int, backend, vocab: int, width: int,
                            sampling=None) -> Optional[DraftModelRoundGraph]:
    """The captured chain round at K for this draft model, as eagle_round_graph's."""
    if not _model_round_applies(runner, target, k, backend, 2, sampling):
        return None
    if runner.length + 2 + k > runner.max_length:  # its own cache: two rows, then the chain
        return None
    key = ("draft_round", id(runner), k, vocab, width, None if sampling is None else sampling.key)
    return ChainGraphs.of(target).get(
        key, lambda: DraftModelRoundGraph(runner, target, k, backend, vocab, width, sampling))



def host_tree_round_graph(target, nodes: int, backend, width: int, warp: Optional[tuple] = None
                          ) -> Optional[HostTreeRoundGraph]:
    """The captured verification of a host-drafted tree of `nodes` nodes, built on first use and kept with
    the target's graphs; None where it does not apply (as for Medusa's, a tapped target too: its features
    would be the taps), and where the block does not fit after the cache's end."""
    rows = nodes + 1
    if not (ChainGraphs.available(target, 2) and backend.compiles_kernels and target._decode_path(rows)
            and getattr(target, "takes_device_starts", False)) or getattr(target, "tap_layers", ()):
        return None
    if target.length + rows > target.max_length:
        return None
    key = ("host_tree_round", nodes, width, warp)
    return ChainGraphs.of(target).get(key, lambda: HostTreeRoundGraph(target, nodes, backend, width, warp))
