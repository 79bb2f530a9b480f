"""A separate, smaller draft model sharing the target's tokenizer: drafts a chain of K autoregressively."""
from __future__ import annotations

import torch

from engine.drafters.base import DecodeState, Draft, Drafter, DraftStart, RoundCommit, draw_token
from engine.runner import CausalRunner, fit_vocab, to_device


class DraftModelDrafter(Drafter):
    name = "draft"

    def __init__(self, runner: CausalRunner):
        self.runner = runner
        self.cached = 0  # committed tokens in the draft cache
        self.base = 0  # committed tokens when the last draft was made
        self.last_k = 0

    def start(self, state: DecodeState, start: DraftStart) -> None:
        self.runner.reset()
        prefix = state.tokens[:-1]
        if prefix:
            self.runner.forward(torch.tensor(prefix, dtype=torch.long, device=self.runner.device))
        self.cached = len(prefix)

    def propose(self, state: DecodeState, k: int) -> Draft:
        feed = to_device(state.tokens[self.cached:], self.runner.device)
        uniforms = state.uniforms(k)
        tokens, probs = [], []
        for i in range(k):
            logits = fit_vocab(self.runner.forward(feed).logits[-1:], state.vocab_size)  # [1, V target]
            token, q = draw_token(state, logits, uniforms[i:i + 1])  # [1], [1, V] or None
            tokens.append(token)
            probs.append(q)
            feed = token
        self.base, self.last_k = len(state.tokens), k
        return Draft(tokens=torch.cat(tokens), probs=None if probs[0] is None else torch.cat(probs))

    def commit(self, state: DecodeState, commit: RoundCommit) -> None:
        # the cache holds the committed tokens plus drafts 1..K-1; keep the accepted ones among those
        valid = self.base + min(commit.accepted, self.last_k - 1)
        self.runner.rollback(valid)
        self.cached = valid
