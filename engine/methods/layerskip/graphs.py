"""Layer skip's replayed round: the target's first layers draft into its own cache, the full target verifies
(LayerSkipRoundGraph)."""
from __future__ import annotations

from typing import Optional

import torch.nn.functional as F

from engine.core.graphs import (
    ChainGraphs,
    ChainRoundGraph,
    attention_width,
    model_chain_steps,
    model_round_applies,
)
from engine.models.runner import fill_unknown


class LayerSkipRoundGraph(ChainRoundGraph):
    """Layer skip's chain: its draft runner is the target's first L layers over the target's own cache, in
    which the last verification left every committed token's rows but the next token's. So the drafting feeds
    the next token at the row after the accepted ones (the block's start + 1 + accepted) and draws the chain
    from there; the target's block then writes over the same rows with all its layers."""

    def __init__(self, runner, target, k: int, backend, vocab: int, width: int, sampling=None):
        self._chain_buffers(target, k)
        depth, visible = runner.chain_block(1)
        draft_kv = attention_width(runner, 1)

        def draft():
            row = self.start + 1 + self.accepted  # [1]: the next token's row
            feed = fill_unknown(self.next_token, runner.vocab_size, runner.input_fill)  # [1]
            _, logits = runner.block_step(F.embedding(feed, runner.embed_weight), row, depth, visible,
                                           draft_kv)  # [1, V]
            return model_chain_steps(runner, logits, row + 1, k, draft_kv, vocab, sampling, self.draft_u)

        self._draft = draft
        self._capture_chain(target, backend, width, sampling)

    def seed(self, launched, drafter) -> None:
        """Take a round launched without the graph: its outcome, chain and block start (the cache is the
        target's, so there is nothing of the drafter's own to take)."""
        self._seed_chain(launched)


def layer_skip_round_graph(runner, target, k: int, backend, vocab: int, width: int,
                           sampling=None) -> Optional[LayerSkipRoundGraph]:
    """The captured chain round at K for this layer-skip runner, as eagle_round_graph's."""
    if not model_round_applies(runner, target, k, backend, 1, sampling):
        return None
    key = ("layerskip_round", id(runner), k, vocab, width, None if sampling is None else sampling.key)
    return ChainGraphs.of(target).get(
        key, lambda: LayerSkipRoundGraph(runner, target, k, backend, vocab, width, sampling))
