"""A whole speculative round as one CUDA graph that feeds itself on the device: Medusa's.

A Medusa round queued behind an unread one (SpeculativeDecoder._launch_after) needs nothing from the host: the
last round's outcome (accepted count, path, next token), the heads' drafts from every row of its block and the
block's start are on the device. Queued op by op, that round is some forty launches and copies, and on the
shipped pair the host's share of them took twice a plain round. Captured (greedy, or sampled with the round's
uniforms copied in), a round is one replay:

  1. the last block keeps its accepted path in the target's cache (its rows moved down on the device);
  2. the new block: the last next token, then the accepted row's tree;
  3. the target's step over the block (decode path), the tree verification, the event's readout;
  4. the heads' drafts from every row of the new block;
  5. the outcome, the drafts and the new start become the next replay's inputs (the graph's own buffers).

The buffers are seeded from a round that ran without the graph (seed) before the first replay after it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from engine.chain_graph import ChainGraphs, graph_pool, medusa_rows
from engine.runner import graph_capture


class MedusaRoundGraph:
    """One Medusa round at a fixed tree (greedy or sampled): graph.replay() runs it; its outputs (tokens,
    hidden, logits, result, values) are static tensors that the next replay overwrites."""

    def __init__(self, target, heads, tree, flat_index: torch.Tensor, backend, vocab: int, width: int,
                 warp: Optional[tuple] = None):
        """warp: (temperature, top_k, top_p) for sampled rounds (recursive rejection sampling with the
        uniforms the host copies into `uniforms` before each replay), None for greedy ones."""
        device, n = target.device, len(tree.parents)
        self.target, self.depth, self.nodes = target, tree.depth, n
        self.parents = torch.tensor(tree.parents, dtype=torch.long)  # [N] host, for the events
        self.block_parents = torch.cat((torch.tensor([-1]), self.parents + 1))  # [N+1] host
        # the last round's outcome and drafts, and its block's start: the replay's inputs
        self.accepted = torch.zeros(1, dtype=torch.long, device=device)
        self.path = torch.full((n,), -1, dtype=torch.long, device=device)
        self.next_token = torch.zeros(1, dtype=torch.long, device=device)
        self.early = torch.zeros(n + 1, n, dtype=torch.long, device=device)  # [N+1, N]
        # a start past the cache's end for the warm-up and the capture: they write only free rows
        self.start = torch.full((1,), target.length, dtype=torch.long, device=device)
        self.uniforms = torch.zeros(1, n + 1, dtype=torch.float32, device=device)  # [1, N+1], sampled rounds
        self.fed_by = None  # the launched round whose outcome the buffers hold (see seed)
        block_depth, block_visible = target._tree_block(self.block_parents)
        tree_parents = self.parents.to(device)  # [N]
        minus_one = torch.full((1,), -1, dtype=torch.long, device=device)
        rows = target._arange[:self.depth]  # [D]

        def round_():
            keep_path(target, self.start, self.path[:self.depth], rows)
            path = torch.cat((minus_one, self.path))  # [N+1]: row 0 when nothing was accepted
            row = path.index_select(0, self.accepted) + 1  # [1]
            tokens = torch.cat((self.next_token, self.early.index_select(0, row)[0]))  # [N+1]
            start = self.start + 1 + self.accepted  # [1]
            x = F.embedding(tokens, target.embed_weight)  # [N+1, H]
            hidden, logits = target._block_step(x, start, block_depth, block_visible, 0)
            if warp is None:
                result = backend.verify_tree_greedy(logits[None], tokens[None, 1:], tree_parents)
            else:  # one-hot q: Medusa's tokens are its heads' top ranks
                result = backend.verify_tree_stochastic(logits[None], tokens[None, 1:], tree_parents, None,
                                                        self.uniforms, *warp)
            values = backend.readout(logits, result, tokens[1:], 1.0 if warp is None else warp[0], width)
            early = medusa_rows(target, heads, hidden, tree, flat_index, vocab)  # [N+1, N]
            self.accepted.copy_(result.accepted[:1])
            self.path.copy_(result.path[0])
            self.next_token.copy_(result.next_token[:1].clamp_min(0))  # -1 flags NaN: the readout raises
            self.early.copy_(early)
            self.start.copy_(start)
            return tokens, hidden, logits, result, values

        self._round = round_  # keeps alive what the graph reads
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            round_()  # warm-up outside the capture (cuBLAS workspaces, lazy kernels)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with graph_capture(self.graph, graph_pool(target)):
            self.tokens, self.hidden, self.logits, self.result, self.values = round_()

    @property
    def rows(self) -> int:
        return self.nodes + 1

    def seed(self, launched, drafter) -> None:
        """Take a round launched without the graph as the next replay's last round: its outcome (device),
        the drafts from its rows (the Medusa drafter's early [rows, N]) and its block's start."""
        result, early = launched.result, drafter.early
        self.accepted.copy_(result.accepted[:1])
        if result.path.shape[-1] == self.nodes:
            self.path.copy_(result.path[0])
        else:  # an empty draft: nothing to keep
            self.path.fill_(-1)
        self.next_token.copy_(launched.next_token_on_device)
        self.early[:early.shape[0]].copy_(early)
        self.start.fill_(launched.block_start)


def keep_path(target, start: torch.Tensor, path: torch.Tensor, rows: torch.Tensor) -> None:
    """The tree block at cache row start (device [1]; its row 0 the last committed token) keeps its accepted
    path: rows start+1+i take rows start+1+path[i] (path [D], -1 past the accepted count: those rows copy
    themselves). The gather comes first, so rows moving down over each other are safe."""
    source = start + 1 + torch.where(path >= 0, path, rows)  # [D]
    target.kv.index_copy_(3, start + 1 + rows, target.kv.index_select(3, source))


def medusa_round_graph(target, heads, tree, flat_index: torch.Tensor, backend, vocab: int, width: int,
                       warp: Optional[tuple] = None) -> Optional[MedusaRoundGraph]:
    """The captured round for this tree, built on first use and kept with the target's graphs; None where it
    does not apply: no graphs, no decode path for the block, no compiled kernels, or too little free cache
    for the capture's rows."""
    n = len(tree.parents) + 1
    if not (ChainGraphs.available(target, 2) and backend.compiles_kernels and target._decode_path(n)):
        return None
    if target.length + 1 + tree.depth + n > target.max_length:
        return None
    key = ("medusa_round", id(heads), tree, vocab, width, warp)
    return ChainGraphs.of(target).get(
        key, lambda: MedusaRoundGraph(target, heads, tree, flat_index, backend, vocab, width, warp))

