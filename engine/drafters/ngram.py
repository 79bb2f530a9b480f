"""Prompt lookup: match the last n tokens of the context earlier in it and propose what followed."""
from __future__ import annotations

from engine.drafters.base import DecodeState, Draft, Drafter
from engine.runner import to_device


def lookup_continuation(tokens: list, max_n: int, k: int) -> list:
    """The up-to-k tokens that followed the most recent earlier occurrence of the longest suffix (n <= max_n)
    of `tokens`; [] when no suffix of length >= 1 occurs earlier."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), 0, -1):
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):  # most recent occurrence first
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


class NgramDrafter(Drafter):
    name = "ngram"

    def propose(self, state: DecodeState, k: int) -> Draft:
        proposal = lookup_continuation(state.tokens, state.config.ngram_n, k)
        tokens = to_device(proposal, state.device)
        return Draft(tokens=tokens)
