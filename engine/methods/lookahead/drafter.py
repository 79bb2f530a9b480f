"""Jacobi lookahead decoding as a deterministic tree drafter.

A window of W guess tokens sits after the last committed token. Every round the window rides along in the
verification forward as one branch of the draft tree; the target's argmax at each window node is a Jacobi
update of the next guess. The updated trajectory feeds an n-gram pool; n-grams from the pool that start at
the last committed token form the other branches. All drafts are one-hot (q = 1), so tree verification keeps
the output exactly the target's."""
from __future__ import annotations

from collections import OrderedDict

from engine.methods.base import DecodeState, Draft, Drafter, DrafterNeeds, DraftStart, RoundCommit
from engine.methods.tree import as_tensors, build_trie

POOL_PER_KEY = 8  # n-grams kept per first token (most recent first)


class LookaheadDrafter(Drafter):
    name = "lookahead"
    drafts_on_host = True
    needs = DrafterNeeds(block_argmax=True)

    def __init__(self, window: int = 4, ngram: int = 4, max_candidates: int = 3):
        self.window_size = window
        self.ngram = ngram  # n-gram length including the key token
        self.max_candidates = max_candidates
        self.pool: dict = {}
        self.window: list = []
        self._window_nodes: list = []

    def start(self, state: DecodeState, start: DraftStart) -> None:
        self.pool = {}
        self._add_ngrams(state.tokens)
        # initial guesses: the most recent context tokens (any tokens work; Jacobi iterations refine them)
        self.window = list(state.tokens[-self.window_size:])
        while len(self.window) < self.window_size:
            self.window.append(state.tokens[-1])

    def propose(self, state: DecodeState, k: int) -> Draft:
        last = state.tokens[-1]
        candidates = [list(c) for c in self.pool.get(last, [])][:self.max_candidates]
        paths = [c[:k] for c in candidates] + [self.window[:max(k, 1)]]
        tokens, parents = build_trie(paths)
        self._window_nodes = self._path_nodes(tokens, parents, paths[-1])
        tok, par = as_tensors(tokens, parents)
        return Draft(tokens=tok, parents=par)

    @staticmethod
    def _path_nodes(tokens: list, parents: list, path: list) -> list:
        """Node indices of `path` inside the trie."""
        nodes, parent = [], -1
        for token in path:
            node = next(i for i, (t, p) in enumerate(zip(tokens, parents)) if t == token and p == parent)
            nodes.append(node)
            parent = node
        return nodes

    def commit(self, state: DecodeState, commit: RoundCommit) -> None:
        accepted = commit.accepted
        # Jacobi step: the target's argmax after the root and after each window node (block row 0 = root)
        rows = [0] + [n + 1 for n in self._window_nodes]
        predictions = [commit.block_argmax[r] for r in rows]  # [W+1] guesses for positions L+1 .. L+W+1
        root = state.tokens[-(accepted + 2)]  # the round's last committed token, before this round's tokens
        self._add_ngrams([root] + predictions)
        self._add_ngrams(state.tokens[-(self.ngram + accepted + 1):])
        shift = accepted + 1  # committed tokens this round; the window moves past them
        fresh = predictions[shift:]
        self.window = (fresh + predictions[-1:] * self.window_size)[:self.window_size]

    def _add_ngrams(self, sequence: list) -> None:
        n = self.ngram
        for i in range(len(sequence) - 1):
            gram = tuple(sequence[i + 1:i + n])
            if not gram:
                continue
            bucket = self.pool.setdefault(sequence[i], OrderedDict())
            bucket.pop(gram, None)
            bucket[gram] = None
            bucket.move_to_end(gram, last=False)
            while len(bucket) > POOL_PER_KEY:
                bucket.popitem(last=True)
