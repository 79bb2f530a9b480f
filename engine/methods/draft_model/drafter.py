"""A separate, smaller draft model sharing the target's tokenizer: drafts a chain of K autoregressively."""
from __future__ import annotations

import torch

from engine.core.graphs import ChainGraphs, chain_sampling
from engine.methods.base import DecodeState, Draft, Drafter, DraftStart, RoundCommit, draw_token
from engine.methods.draft_model.graphs import draft_model_chain, draft_model_round, prepare_draft_rounds
from engine.models.runner import CausalRunner, fit_vocab, to_device


class DraftModelDrafter(Drafter):
    name = "draft"

    def __init__(self, runner: CausalRunner, target=None):
        self.runner = runner
        self.round_target = target  # the target its round graph verifies with (None: no round graph)
        self.cached = 0  # committed tokens in the draft cache
        self.base = 0  # committed tokens when the last draft was made
        self.last_k = 0

    def start(self, state: DecodeState, start: DraftStart) -> None:
        self.runner.reset()
        prefix = state.tokens[:-1]
        if prefix:
            self.runner.forward(torch.tensor(prefix, dtype=torch.long, device=self.runner.device))
        self.cached = len(prefix)
        sampling = chain_sampling(state)
        if ChainGraphs.rounds_available(self.runner, sampling):
            prepare_draft_rounds(self.runner, state.config.k, state.vocab_size, sampling)

    def propose(self, state: DecodeState, k: int) -> Draft:
        feed = to_device(state.tokens[self.cached:], self.runner.device)
        self.base, self.last_k = len(state.tokens), k
        sampling = chain_sampling(state)
        uniforms = None if sampling is None else state.uniforms(k)  # [k] on the device
        # the forward over the feed and the chain in one graph (K = 1 too: a depth-1 round timed another way
        # than deeper ones made calibration's per-step cost their difference of two code paths)
        if ChainGraphs.rounds_available(self.runner, sampling):
            drafted = draft_model_round(self.runner, feed, k, state.vocab_size, sampling, uniforms)
            if drafted is not None:
                return Draft(tokens=drafted[0], probs=drafted[1])
        logits = self.runner.forward(feed).logits[-1:]  # [1, V]: the distribution of draft token 0
        if ChainGraphs.available(self.runner, k, sampling):
            drafted = draft_model_chain(self.runner, logits, k, state.vocab_size, sampling, uniforms)
            if drafted is not None:
                return Draft(tokens=drafted[0], probs=drafted[1])
        return self._eager_chain(state, logits, k, uniforms)

    @property
    def replays_rounds(self) -> bool:
        """A round after an unread one may be a replay of the round graph (round_graph)."""
        return self.round_target is not None

    def round_graph(self, state: DecodeState, config, width: int):
        """The rounds as one self-feeding graph replay each (engine.methods.draft_model.graphs
        .DraftModelRoundGraph), where the fused round applies."""
        sampling = chain_sampling(state)
        if not ChainGraphs.rounds_available(self.runner, sampling):
            return None
        from engine.methods.draft_model.graphs import draft_model_round_graph

        return draft_model_round_graph(self.runner, self.round_target, config.k, state.backend,
                                       state.vocab_size, width, sampling)

    def _eager_chain(self, state: DecodeState, logits: torch.Tensor, k: int, uniforms: torch.Tensor) -> Draft:
        """Draw k tokens one step at a time, starting from the logits [1, V] of draft token 0."""
        tokens, probs = [], []
        for i in range(k):
            # [1], [1, V]
            uniform = None if uniforms is None else uniforms[i:i + 1]
            token, q = draw_token(state, fit_vocab(logits, state.vocab_size), uniform)
            tokens.append(token)
            probs.append(q)
            if i < k - 1:
                logits = self.runner.forward(token).logits[-1:]
        return Draft(tokens=torch.cat(tokens), probs=None if probs[0] is None else torch.cat(probs))

    def commit(self, state: DecodeState, commit: RoundCommit) -> None:
        if commit.fed_ahead:  # the replayed round after this one fed the draft model these tokens
            self.base += commit.accepted + 1
            self.cached = self.base
            self.runner.set_length(self.base + self.last_k - 1)  # the host's view: the replay's chain rows
            return
        # the cache holds the committed tokens plus drafts 1..K-1; keep the accepted ones among those
        valid = self.base + min(commit.accepted, self.last_k - 1)
        self.runner.rollback(valid)
        self.cached = valid
