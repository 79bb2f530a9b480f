"""Greedy draft chains captured as one CUDA graph each: the draft model's K steps, EAGLE's K head steps.

Drafting K tokens eagerly costs K step replays plus, per step, the argmax, the next input's embedding (EAGLE: the
fusion of feature and token) and a handful of copies, each a launch and some Python: on the shipped pair that is
most of a round. A chain graph queues all of it with one replay. Only greedy drafting is captured (its argmax has
no host input); sampled drafting draws uniforms and runs the sampling kernels eagerly.

A chain graph is specific to (K, the attention width kv); it writes K-1 cache rows after `start`, which it reads
from a device buffer, so one graph serves every cache length up to kv - K.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F

CHAIN_GRAPHS_KEPT = 48  # per drafter; past this, new shapes draft eagerly


class CapturedChain:
    """fn(static inputs...) -> tokens [K], captured once; run() copies new inputs in and replays."""

    def __init__(self, fn: Callable, inputs: tuple, device: torch.device, pool):
        self.inputs = inputs
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn(*inputs)  # warm-up outside the capture (cuBLAS workspaces, lazy kernels)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.tokens = fn(*inputs)  # [K]

    def run(self, *values) -> torch.Tensor:
        """values: one per static input, a tensor (copied in) or an int (filled in)."""
        for buffer, value in zip(self.inputs, values):
            if isinstance(value, int):
                buffer.fill_(value)
            else:
                buffer.copy_(value)
        self.graph.replay()
        return self.tokens.clone()  # the pool is shared with other graphs of the runner


def _one_step(runner, x: torch.Tensor, start: torch.Tensor, kv: int):
    """One token through the runner at cache row `start` (device [1]) -> (feature [1, H], logits [1, V])."""
    depth, block_visible = runner._chain_block(1)
    return runner._block_step(x, start, depth, block_visible, kv)


class ChainGraphs:
    """The captured chains of one runner, by (K, kv, ...), kept on the runner so that every generation (each
    builds its own drafter) reuses them. `available` says whether capture applies."""

    def __init__(self):
        self._graphs: Dict[tuple, CapturedChain] = {}

    @classmethod
    def of(cls, runner) -> "ChainGraphs":
        graphs = getattr(runner, "_chain_graphs", None)
        if graphs is None:
            graphs = runner._chain_graphs = cls()
        return graphs

    def __len__(self) -> int:
        return len(self._graphs)

    @staticmethod
    def available(runner, greedy: bool, k: int) -> bool:
        """Greedy chains of 2 or more on a Llama-family runner that replays graphs."""
        return (greedy and k > 1 and runner.device.type == "cuda" and getattr(runner, "use_graphs", False)
                and hasattr(runner, "_block_step"))

    def get(self, key: tuple, build: Callable[[], CapturedChain]) -> Optional[CapturedChain]:
        if key not in self._graphs:
            if len(self._graphs) >= CHAIN_GRAPHS_KEPT:
                return None
            self._graphs[key] = build()
        return self._graphs[key]


def _pool(runner):
    if runner._graph_pool is None:
        runner._graph_pool = torch.cuda.graph_pool_handle()
    return runner._graph_pool


def draft_model_chain(runner, first_logits: torch.Tensor, k: int, vocab: int):
    """Greedy chain of k tokens from a draft model whose last forward gave first_logits [1, V] (cache length L):
    token 0 is its argmax, tokens 1..k-1 each come from one more step. Appends k-1 rows; returns tokens [k] or
    None when no graph could be made (the caller drafts eagerly)."""
    start_row = runner.length
    kv = runner._kv_width(start_row + k)
    device = runner.device

    def build() -> CapturedChain:
        logits_in = torch.zeros_like(first_logits)  # [1, V]
        start = torch.full((1,), start_row, dtype=torch.long, device=device)

        def chain(logits, start):
            token = logits[:, :vocab].argmax(-1)  # [1]
            tokens = [token]
            for i in range(k - 1):
                _, logits = _one_step(runner, F.embedding(token, runner.embed_weight), start + i, kv)
                token = logits[:, :vocab].argmax(-1)
                tokens.append(token)
            return torch.cat(tokens)  # [k]

        return CapturedChain(chain, (logits_in, start), device, _pool(runner))

    graph = ChainGraphs.of(runner).get((k, kv, vocab, first_logits.shape[-1]), build)
    if graph is None:
        return None
    tokens = graph.run(first_logits, start_row)
    runner._length = start_row + k - 1
    return tokens


def eagle_chain(head, feature: torch.Tensor, k: int, vocab: int):
    """Greedy EAGLE chain of k tokens from the predicted feature [1, H] after the root: token i is the argmax
    of the target's head on feature i; feature i+1 comes from one head step on (feature i, token i). The head's
    runner shares the target's final norm and LM head, so its step's logits are the next token's logits (no
    second LM-head product). Appends k-1 rows to the head's cache; returns tokens [k] or None."""
    runner = head.runner
    start_row = runner.length
    kv = runner._kv_width(start_row + k)
    device = runner.device

    def build() -> CapturedChain:
        feature_in = torch.zeros_like(feature)  # [1, H]
        start = torch.full((1,), start_row, dtype=torch.long, device=device)

        def chain(feature, start):
            logits = head.logits(feature)  # [1, V]
            token = logits[:, :vocab].argmax(-1)
            tokens = [token]
            for i in range(k - 1):
                feature, logits = _one_step(runner, head.fuse(feature, token), start + i, kv)
                token = logits[:, :vocab].argmax(-1)
                tokens.append(token)
            return torch.cat(tokens)  # [k]

        return CapturedChain(chain, (feature_in, start), device, _pool(runner))

    graph = ChainGraphs.of(runner).get((k, kv, vocab), build)
    if graph is None:
        return None
    tokens = graph.run(feature, start_row)
    runner._length = start_row + k - 1
    return tokens


def medusa_draft(target, heads, hidden: torch.Tensor, tree, flat_index: torch.Tensor, vocab: int):
    """Medusa's whole proposal (the heads on the verified feature hidden [H], their top ranks, the tree's tokens)
    as one graph replay; returns tokens [N], or None where graphs do not apply (the caller runs it eagerly)."""
    if not ChainGraphs.available(target, True, 2):
        return None

    def build() -> CapturedChain:
        def propose(feature):
            logits = heads.logits(target, feature)[:tree.depth, :vocab]  # [depth, V]
            return torch.topk(logits, tree.width, dim=-1).indices.flatten()[flat_index]  # [N]

        return CapturedChain(propose, (torch.zeros_like(hidden),), target.device, _pool(target))

    graph = ChainGraphs.of(target).get(("medusa", id(heads), tree, vocab), build)
    return None if graph is None else graph.run(hidden)
