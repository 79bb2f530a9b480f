"""The draft model's captured graphs: its K-step chain (draft_model_chain), its whole round (the forward
over what was committed since its last round, then the chain: draft_model_round) and the replayed round
with the target's verification behind it (DraftModelRoundGraph)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from engine.core.graphs import (
    CapturedChain,
    ChainGraphs,
    ChainRoundGraph,
    ChainSampling,
    attention_width,
    capture_feed_lengths,
    graph_pool,
    model_chain_steps,
    model_round_applies,
)
from engine.models.runner import fill_unknown


def draft_model_chain(runner, first_logits: torch.Tensor, k: int, vocab: int,
                      sampling: Optional[ChainSampling] = None, uniforms: Optional[torch.Tensor] = None):
    """A chain of k tokens from a draft model whose last forward gave first_logits [1, V] (cache length L):
    token 0 is drawn from them, tokens 1..k-1 each after one more step. Appends k-1 rows; returns (tokens [k],
    q [k, V] or None when greedy), or None when no graph could be made (the caller drafts eagerly).
    uniforms: [k] on the device, for a sampled chain."""
    start_row = runner.length
    kv = runner.kv_width(start_row + k)
    device = runner.device

    def build() -> CapturedChain:
        logits_in = torch.zeros_like(first_logits)  # [1, V]
        start = torch.full((1,), start_row, dtype=torch.long, device=device)
        u_in = torch.zeros(k, dtype=torch.float32, device=device)  # [k]

        def chain(logits, start, u):
            return model_chain_steps(runner, logits, start, k, kv, vocab, sampling, u)

        return CapturedChain(chain, (logits_in, start, u_in), device, graph_pool(runner))

    key = ("draft", k, kv, vocab, first_logits.shape[-1], None if sampling is None else sampling.key)
    graph = ChainGraphs.of(runner).get(key, build)
    if graph is None:
        return None
    drafted = graph.run(first_logits, start_row, uniforms)
    runner.set_length(start_row + k - 1)
    return drafted


def draft_model_round(runner, feed: torch.Tensor, k: int, vocab: int,
                      sampling: Optional[ChainSampling] = None, uniforms: Optional[torch.Tensor] = None):
    """A draft model's whole proposal as one graph: the forward over feed [n] (the tokens committed since its
    last round, at the cache's end L) and the k-token chain drawn from its last row (draft_model_chain's
    chain, one row further on). Appends n + k - 1 rows; returns (tokens [k], q [k, V] or None) or None where
    no graph applies (the caller then runs the forward and the chain apart)."""
    start_row = runner.length
    graph = _draft_round_graph(runner, feed.numel(), k, vocab, sampling)
    if graph is None:
        return None
    drafted = graph.run(feed, start_row, uniforms)
    runner.set_length(start_row + feed.numel() + k - 1)
    return drafted


def prepare_draft_rounds(runner, k: int, vocab: int, sampling: Optional[ChainSampling] = None) -> int:
    """Capture the round graphs of every feed length a round at K can have (1..k+1) now, before the first
    round: captured when first met, a length seen only late in a timed run (all k accepted) stalled it (the
    shipped pair on an H200: K = 8 went from 1.26x to 0.92x over plain decoding). Returns how many exist."""
    return capture_feed_lengths(runner, k, 2 * k + 1,
                                lambda n: _draft_round_graph(runner, n, k, vocab, sampling))


def _draft_round_graph(runner, n: int, k: int, vocab: int, sampling: Optional[ChainSampling]):
    """The captured round for a feed of n tokens at K, built on first use; None off the decode path. One
    graph per (n, k): the step reads its start on the device, so every cache length shares it."""
    if not runner.decode_path(n) or n > k + 1:
        return None
    device, start_row = runner.device, runner.length

    def build() -> CapturedChain:
        feed_in = torch.zeros(n, dtype=torch.long, device=device)  # [n]
        start = torch.full((1,), start_row, dtype=torch.long, device=device)
        u_in = torch.zeros(k, dtype=torch.float32, device=device)  # [k]
        depth, block_visible = runner.chain_block(n)

        def round_(tokens, start, u):
            tokens = fill_unknown(tokens, runner.vocab_size, runner.input_fill)
            _, logits = runner.block_step(F.embedding(tokens, runner.embed_weight), start, depth,
                                           block_visible, 0)  # [n, V]
            return model_chain_steps(runner, logits[-1:], start + n, k, 0, vocab, sampling, u)

        return CapturedChain(round_, (feed_in, start, u_in), device, graph_pool(runner))

    key = ("draft-round", n, k, vocab, None if sampling is None else sampling.key)
    return ChainGraphs.of(runner).get(key, build)


class DraftModelRoundGraph(ChainRoundGraph):
    """The draft model's chain. Its cache holds the committed tokens and the last chain's first K-1 tokens, so
    after `accepted` of them it lacks one token (the next one) or, all K accepted, two (the chain's last and
    the next one): it reads two rows at base + min(accepted, K-1), the second stray when it lacks one, and
    the chain starts from the last real row's logits and writes over the stray one."""

    def __init__(self, runner, target, k: int, backend, vocab: int, width: int, sampling=None):
        self._chain_buffers(target, k)
        # committed tokens when the last chain was drafted: the draft cache's rows before that chain
        self.base = torch.full((1,), runner.length, dtype=torch.long, device=target.device)
        depth, visible = runner.chain_block(2)
        draft_kv = attention_width(runner, 2)

        def draft():
            accepted = self.accepted
            whole = (accepted == k).long()  # [1]: 1 when the chain's last token is not in the cache
            row = self.base + accepted - whole  # [1]: base + min(accepted, K - 1)
            last = self.draft[k - 1:]  # [1]
            feed = torch.cat((torch.where(whole > 0, last, self.next_token), self.next_token))  # [2]
            feed = fill_unknown(feed, runner.vocab_size, runner.input_fill)
            _, logits = runner.block_step(F.embedding(feed, runner.embed_weight), row, depth, visible,
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


def draft_model_round_graph(runner, target, k: int, backend, vocab: int, width: int,
                            sampling=None) -> Optional[DraftModelRoundGraph]:
    """The captured chain round at K for this draft model, as eagle_round_graph's."""
    if not model_round_applies(runner, target, k, backend, 2, sampling):
        return None
    if runner.length + 2 + k > runner.max_length:  # its own cache: two rows, then the chain
        return None
    key = ("draft_round", id(runner), k, vocab, width, None if sampling is None else sampling.key)
    return ChainGraphs.of(target).get(
        key, lambda: DraftModelRoundGraph(runner, target, k, backend, vocab, width, sampling))
