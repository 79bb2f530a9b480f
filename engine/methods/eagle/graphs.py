"""EAGLE's captured graphs: the head's K-step chain and its whole round (eagle_chain, eagle_round), the
replayed chain round (EagleRoundGraph) and the replayed greedy tree round (EagleTreeRoundGraph). EAGLE-3
drafts through the same graphs with its own head."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from engine.core.graphs import (
    CapturedChain,
    ChainGraphs,
    ChainRoundGraph,
    ChainSampling,
    RoundGraph,
    attention_width,
    capture_feed_lengths,
    draw_chain_token,
    graph_pool,
    keep_path,
    one_step,
    stack_drafts,
)


def eagle_chain_steps(head, feature: torch.Tensor, start: torch.Tensor, k: int, kv: int, vocab: int,
                      sampling: Optional[ChainSampling], u: torch.Tensor,
                      logits: Optional[torch.Tensor] = None):
    """k tokens of an EAGLE chain from the predicted feature [1, H] after the root: token i is drawn from the
    target's head on feature i; feature i+1 comes from one head step on (feature i, token i) at cache row
    start + i (start: [1] on the device). logits: feature 0's [1, V] where the head's step gave them already
    (its runner shares the target's final norm and LM head); None computes them. Returns (tokens [k], q [k, V]
    or None)."""
    if logits is None:
        logits = head.logits(feature)  # [1, V]
    token, q = draw_chain_token(logits, vocab, sampling, u, 0)
    tokens, probs = [token], [q]
    for i in range(1, k):
        feature, logits = one_step(head.runner, head.fuse(feature, token), start + i - 1, kv)
        token, q = draw_chain_token(logits, vocab, sampling, u, i)
        tokens.append(token)
        probs.append(q)
    return stack_drafts(tokens, probs)


def eagle_chain(head, feature: torch.Tensor, logits: torch.Tensor, k: int, vocab: int,
                sampling: Optional[ChainSampling] = None, uniforms: Optional[torch.Tensor] = None):
    """An EAGLE chain of k tokens from the predicted feature [1, H] after the root and its logits [1, V]
    (eagle_chain_steps) as one graph. The head's runner shares the target's final norm and LM head, so its
    step's logits are the next token's logits (no second LM-head product). Appends k-1 rows to the head's
    cache; returns (tokens [k], q [k, V] or None) or None."""
    runner = head.runner
    start_row = runner.length
    kv = runner.kv_width(start_row + k)
    device = runner.device

    def build() -> CapturedChain:
        feature_in, logits_in = torch.zeros_like(feature), torch.zeros_like(logits)  # [1, H], [1, V]
        start = torch.full((1,), start_row, dtype=torch.long, device=device)
        u_in = torch.zeros(k, dtype=torch.float32, device=device)  # [k]

        def chain(feature, logits, start, u):
            return eagle_chain_steps(head, feature, start, k, kv, vocab, sampling, u, logits)

        return CapturedChain(chain, (feature_in, logits_in, start, u_in), device, graph_pool(runner))

    key = ("eagle", k, kv, vocab, None if sampling is None else sampling.key)
    graph = ChainGraphs.of(runner).get(key, build)
    if graph is None:
        return None
    drafted = graph.run(feature, logits, start_row, uniforms)
    runner.set_length(start_row + k - 1)
    return drafted


def eagle_round_body(head, features: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor, k: int, kv: int,
                     vocab: int, sampling: Optional[ChainSampling], u: torch.Tensor):
    """EAGLE's whole proposal: the head's step over the n positions committed since its last round (the
    target's features there [n, F], as the verification gave them, and each one's next token [n]), at cache
    rows start..start+n-1, then the k-token chain from the last predicted feature. kv: the attention width
    (0 on the decode path, which reads start on the device). Returns (tokens [k], q [k, V] or None)."""
    predicted, logits = head_step(head, features, tokens, start, kv, with_logits=True)  # [n, H], [n, V]
    return eagle_chain_steps(head, predicted[-1:], start + tokens.shape[0], k, kv, vocab, sampling, u,
                             logits[-1:])


def head_step(head, features: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor,
              kv: int, with_logits: bool = False):
    """The EAGLE head's step over n committed positions (the target's features [n, F], next tokens [n]) at
    cache rows start..start+n-1, inside a round's graph; returns the predicted features [n, H] (with_logits:
    and the next tokens' logits [n, V] from them, which the step computes anyway)."""
    depth, block_visible = head.runner.chain_block(tokens.shape[0])
    x = head.fuse(head.true_features(features), tokens)  # [n, H]
    predicted, logits = head.runner.block_step(x, start, depth, block_visible, kv)
    return (predicted, logits) if with_logits else predicted


def eagle_round(head, features: torch.Tensor, tokens: torch.Tensor, k: int, vocab: int,
                sampling: Optional[ChainSampling] = None, uniforms: Optional[torch.Tensor] = None):
    """eagle_round_body as one graph per (n, K) on the decode path, like the draft model's round: appends
    n + k - 1 rows to the head's cache and returns (tokens [k], q [k, V] or None), or None where no graph
    applies (the caller then steps the head and drafts the chain apart). features [n, F], tokens [n] on the
    device."""
    graph = _eagle_round_graph(head, tokens.numel(), k, features.shape[-1], vocab, sampling)
    return run_at_cache_end(head.runner, graph, tokens.numel() + k - 1, features, tokens, uniforms=uniforms)


def run_at_cache_end(runner, graph, rows: int, features: torch.Tensor, tokens: torch.Tensor, **inputs):
    """graph.run(features, tokens, start, ...) with start the head's cache end, whose length then grows by the
    rows the graph wrote; None where there is no graph (the caller runs the work eagerly)."""
    if graph is None:
        return None
    start_row = runner.length
    out = graph.run(features, tokens, start_row, *inputs.values())
    runner.set_length(start_row + rows)
    return out


def prepare_eagle_rounds(head, k: int, width: int, vocab: int,
                         sampling: Optional[ChainSampling] = None) -> int:
    """Capture EAGLE's round graphs of every feed length a round at K can have (1..k+1) before the first
    round (see prepare_draft_rounds). width: the features' F. Returns how many exist."""
    return capture_feed_lengths(head.runner, k, 2 * k + 1,
                                lambda n: _eagle_round_graph(head, n, k, width, vocab, sampling))


def _eagle_round_graph(head, n: int, k: int, width: int, vocab: int, sampling: Optional[ChainSampling]):
    """The captured EAGLE round for n committed positions at K, built on first use; None off the decode
    path."""
    runner = head.runner
    if not runner.decode_path(n) or n > k + 1:
        return None
    device, start_row = runner.device, runner.length

    def build() -> CapturedChain:
        features_in = torch.zeros(n, width, dtype=runner.dtype, device=device)  # [n, F]
        tokens_in = torch.zeros(n, dtype=torch.long, device=device)  # [n]
        start = torch.full((1,), start_row, dtype=torch.long, device=device)
        u_in = torch.zeros(k, dtype=torch.float32, device=device)  # [k]

        def round_(features, tokens, start, u):
            return eagle_round_body(head, features, tokens, start, k, 0, vocab, sampling, u)

        return CapturedChain(round_, (features_in, tokens_in, start, u_in), device, graph_pool(runner))

    key = ("eagle-round", n, k, width, vocab, None if sampling is None else sampling.key)
    return ChainGraphs.of(runner).get(key, build)


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
        head_kv = attention_width(head.runner, k + 1)

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
        head_kv, grow_kv = attention_width(head.runner, depth + 1), head.runner.max_length
        kv = attention_width(target, nodes + 1)
        rows = target.row_indices(depth)  # [D]
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
            hidden, logits = target.block_step(F.embedding(tokens, target.embed_weight), start, block_depth,
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


def eagle_round_graph(target, head, k: int, backend, vocab: int, width: int,
                      sampling=None) -> Optional[EagleRoundGraph]:
    """The captured chain round at K for this head, built on first use and kept with the target's graphs;
    None where it does not apply (as for Medusa's, and the head's step must be on its decode path too)."""
    rows = k + 1
    if not (ChainGraphs.available(target, 2) and backend.compiles_kernels and target.decode_path(rows)
            and head.runner.decode_path(rows)):
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
    if not (ChainGraphs.available(target, 2) and backend.compiles_kernels and target.decode_path(rows)
            and head.runner.decode_path(depth + 1) and ChainGraphs.available(head.runner, 2)):
        return None
    if target.length + 1 + depth + rows > target.max_length:
        return None
    if head.runner.length + 2 * (depth + 1) + candidates > head.runner.max_length:
        return None
    key = ("eagle_tree_round", id(head), depth, nodes, vocab, width)
    return ChainGraphs.of(target).get(
        key, lambda: EagleTreeRoundGraph(target, head, depth, nodes, backend, vocab, width, grow, candidates))
