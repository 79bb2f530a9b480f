"""Prompt lookup: match the last n tokens of the context earlier in it and propose what followed; where that
gives fewer than K tokens, the corpus's most frequent continuation fills the rest
(engine.methods.ngram.corpus_table, where the target ships a table)."""
from __future__ import annotations

from engine.methods.base import DecodeState, Draft, Drafter
from engine.models.runner import to_device

# a greedy round behind an unread one is a replay of its captured round (engine.methods.ngram.graphs
# .NgramRoundGraph: the lookup on the device)


def lookup_continuation(tokens: list, max_n: int, k: int, table=None) -> list:
    """The up-to-k tokens that followed the most recent earlier occurrence of the longest suffix (n <= max_n)
    of `tokens` ([] when no suffix of length >= 1 occurs earlier), then, with a CorpusTable, the table's
    continuation of the context and those tokens for the slots left."""
    proposal = prompt_lookup(tokens, max_n, k)
    if table is not None and len(proposal) < k and tokens:
        tail = (tokens[-2:] + proposal)[-2:]  # the context's last two tokens, the proposal's included
        proposal = proposal + table.continuation(tail, k - len(proposal))
    return proposal


def prompt_lookup(tokens: list, max_n: int, k: int) -> list:
    """lookup_continuation without a table."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), 0, -1):
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):  # most recent occurrence first
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, target=None, table=None):
        """target: the decoder's target runner, for the round graph (None: rounds are launched apart).
        table: the target's CorpusTable (None: prompt lookup alone)."""
        self.target = target
        self.table = table
        self.committed: list = []  # the run's tokens (state.tokens) as of the last proposal

    def propose(self, state: DecodeState, k: int) -> Draft:
        self.committed = state.tokens
        proposal = lookup_continuation(state.tokens, state.config.ngram_n, k, self.table)
        tokens = to_device(proposal, state.device)
        return Draft(tokens=tokens)

    @property
    def replays_rounds(self) -> bool:
        """A greedy round after an unread one may be a replay of its round graph (round_graph)."""
        return self.target is not None

    def round_graph(self, state: DecodeState, config, width: int):
        if not state.config.sampling.greedy:
            return None
        from engine.methods.ngram.graphs import ngram_round_graph

        return ngram_round_graph(self.target, config.k, state.config.ngram_n, state.backend, width,
                                 self.table)
