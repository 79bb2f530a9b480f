"""Suffix decoding: draft a tree of what most often followed the longest suffix of the context seen before.

Two indexes are searched every round: the generation's own tokens (prompt and output so far) and the
session's memory (the prompts and outputs of earlier suffix generations on this decoder, and an optional
corpus file). In each, the occurrences of the context's last two tokens (or last one) are extended backwards
to their match length, so the longest matching suffix and all of its occurrences come out of one scan. The
continuations of those occurrences, merged into a counted trie, give every node an empirical probability: the
product, along its path, of each token's count over its siblings' counts. The draft takes the most probable
nodes best-first within the node budget.

Draft length adapts to the match: the tree is at most K deep and at most SPEC_FACTOR times the match length
(a long match is a confident one), and nodes below MIN_PROB are left out, so a rare or split continuation
drafts little. Where several match lengths compete, the tree with the highest expected number of accepted
tokens (the sum of its path probabilities) wins. Drafts are one-hot (q = 1): tree verification keeps the
output exactly the target's.
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import warnings
from array import array
from collections import deque
from pathlib import Path
from typing import Optional

import torch

from engine.errors import SpecplayWarning
from engine.files import bounded
from engine.methods.base import DecodeState, Draft, Drafter, DraftStart, RoundCommit
from engine.methods.tree import as_tensors

SEPARATOR = -1  # between documents of an index (never a token id)
MAX_MATCH = 32  # the longest suffix compared
SCAN = 256  # the most recent occurrences of the last one or two tokens looked at, per index and round
PATTERN_CHOICES = 2  # distinct match lengths tried per index (the best-scoring tree wins)
SPEC_FACTOR = 4.0  # draft depth <= SPEC_FACTOR * match length (and <= K): a one-token match drafts 4 deep
MIN_PROB = 0.1  # nodes whose empirical path probability is lower are not drafted
MAX_MEMORY_TOKENS = 1 << 20  # the session memory keeps at most this many tokens (oldest documents go first)
MAX_CORPUS_BYTES = 16 << 20  # a larger corpus file is refused


class SuffixIndex:
    """Documents of token ids in one flat list, with the positions where each 1-gram and 2-gram ends.

    Memory is about three list entries per token. Occurrences of the context's last tokens come from the
    n-gram lists (most recent first) and are measured by comparing backwards, so a query never walks the
    whole list; appending is O(1) per token, so the generation's own index grows with every round."""

    def __init__(self):
        self.tokens: list = []
        self._ends1: dict = {}  # token -> positions i with tokens[i] == token
        self._ends2: dict = {}  # (a, b) -> positions i with tokens[i - 1 : i + 1] == [a, b]

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        seq = self.tokens
        for token in tokens:
            token, i = int(token), len(seq)
            seq.append(token)
            self._ends1.setdefault(token, []).append(i)
            if i and seq[i - 1] != SEPARATOR:
                self._ends2.setdefault((seq[i - 1], token), []).append(i)

    def end_document(self) -> None:
        if self.tokens and self.tokens[-1] != SEPARATOR:
            self.tokens.append(SEPARATOR)

    def truncate(self, length: int) -> None:
        """Forget every token from position `length` on (the n-gram lists hold positions in order: the ones
        to drop are at their ends)."""
        seq = self.tokens
        for i in range(len(seq) - 1, length - 1, -1):
            token = seq[i]
            if token == SEPARATOR:
                continue
            _drop_last(self._ends1, token)
            if i and seq[i - 1] != SEPARATOR:
                _drop_last(self._ends2, (seq[i - 1], token))
        del seq[length:]

    def occurrences(self, context: list) -> list:
        """[(i, n)]: positions i, each followed by a token, where a suffix of `context` of length n ends (n as
        long as the match goes, <= MAX_MATCH). Occurrences of the last two tokens if there are any (every
        longer match is among them), else of the last token."""
        if not context:
            return []
        candidates = []
        if len(context) >= 2:
            candidates = self._followed(self._ends2.get((context[-2], context[-1]), ()))
        if not candidates:
            candidates = self._followed(self._ends1.get(context[-1], ()))
        return [(i, self._match_length(i, context)) for i in candidates]

    def _followed(self, positions) -> list:
        """The most recent SCAN of `positions` that a token follows."""
        seq, found = self.tokens, []
        last = len(seq) - 1
        for i in reversed(positions):
            if i < last and seq[i + 1] != SEPARATOR:
                found.append(i)
                if len(found) == SCAN:
                    break
        return found

    def _match_length(self, i: int, context: list) -> int:
        seq, n = self.tokens, 0
        limit = min(MAX_MATCH, len(context), i + 1)
        if seq[i + 1 - limit:i + 1] == context[len(context) - limit:]:  # the whole window (one C compare)
            return limit
        while n < limit and seq[i - n] == context[-1 - n]:  # a SEPARATOR never matches
            n += 1
        return n

    def continuation(self, i: int, depth: int, vocab: int) -> list:
        """Up to `depth` tokens after position i, cut at the document's end or at a token outside the vocab
        (a corpus tokenized by a tokenizer wider than the target's logits)."""
        out = []
        for token in self.tokens[i + 1:i + 1 + depth]:
            if not 0 <= token < vocab:
                break
            out.append(token)
        return out


def _drop_last(ends: dict, key) -> None:
    positions = ends[key]
    positions.pop()
    if not positions:
        del ends[key]


def counted_trie(sequences) -> dict:
    """Merge sequences into a trie: token -> [count, children] at every level."""
    root: dict = {}
    for sequence in sequences:
        level = root
        for token in sequence:
            entry = level.get(token)
            if entry is None:
                entry = level[token] = [0, {}]
            entry[0] += 1
            level = entry[1]
    return root


def best_tree(sequences, budget: int, min_prob: float = MIN_PROB) -> tuple:
    """The most probable nodes of the counted trie of `sequences`, best-first: (tokens, parents, score).

    A child is never more probable than its parent, so parents come out first (topological order, -1 = the
    root); siblings are distinct tokens. score = the sum of the chosen nodes' path probabilities: the expected
    number of accepted drafts if the target continued like the counts."""
    tokens: list = []
    parents: list = []
    score = 0.0
    heap: list = []  # (-probability, order pushed, token, parent node, children)
    order = itertools.count()

    def push(children: dict, parent: int, prob: float) -> None:
        entries = children.items()
        total = 0
        for _, (count, _) in entries:
            total += count
        for token, (count, grandchildren) in entries:
            p = prob * count / total
            if p >= min_prob:
                heapq.heappush(heap, (-p, next(order), token, parent, grandchildren))

    push(counted_trie(sequences), -1, 1.0)
    while heap and len(tokens) < budget:
        neg_p, _, token, parent, children = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        score -= neg_p
        push(children, len(tokens) - 1, -neg_p)
    return tokens, parents, score


def candidate_trees(index: SuffixIndex, context: list, k: int, budget: int, vocab: int):
    """One draft tree per match length tried (the PATTERN_CHOICES longest found), as best_tree gives them."""
    found = index.occurrences(context)
    lengths = sorted({n for _, n in found}, reverse=True)[:PATTERN_CHOICES]
    if not lengths:
        return
    # the longest match drafts deepest: every tree's continuations are cuts of those
    deepest = min(k, max(1, math.ceil(SPEC_FACTOR * lengths[0])))
    continuations = [(m, index.continuation(i, deepest, vocab)) for i, m in found if m >= lengths[-1]]
    for n in lengths:
        depth = min(k, max(1, math.ceil(SPEC_FACTOR * n)))
        yield best_tree([c if depth == deepest else c[:depth] for m, c in continuations if m >= n], budget)


class SuffixMemory:
    """What suffix decoding remembers across the generations of one decoder (drafters live one generation):
    earlier prompts with their outputs, and corpus files, in one SuffixIndex of bounded size.

    A generation hands its token list over when it starts (`begin`; its drafter extends the list as rounds
    commit) and is indexed when the next one begins or on `finish`, so that a generation is never matched
    twice against itself (its own index covers it) and a stopped generation is remembered as far as it got.
    Corpora take at most half of max_tokens and stay; past max_tokens the oldest generations are forgotten."""

    def __init__(self, max_tokens: int = MAX_MEMORY_TOKENS):
        self.max_tokens = max_tokens
        self.index = SuffixIndex()
        self._documents: deque = deque()  # (tokens, pinned): pinned = a corpus, never forgotten
        self._open = None
        self._corpora: set = set()
        self.begun_with: list = []  # the documents indexed when the last generation began

    @property
    def documents(self) -> int:
        return len(self._documents)

    def begin(self, tokens: list) -> None:
        """A generation starts: index the previous one, and hold this one's (growing) token list.
        begun_with keeps the documents the index then held, in order (what replay() needs)."""
        self.finish()
        self.begun_with = [document for document, _ in self._documents]
        self._open = tokens

    def remember(self, documents) -> None:
        """Index earlier generations (prompt ids and output each, in the order they ran) after what is held:
        a session read back (the window's kept session, an opened trace) continues where it was."""
        self.finish()
        for document in documents:
            self.add(document)

    def held(self) -> list:
        """The documents a generation beginning now would find (begun_with): those indexed, and the open one,
        which begin() indexes first."""
        documents = [document for document, _ in self._documents]
        return documents + ([list(self._open)] if self._open else [])

    def finish(self) -> None:
        if self._open is not None:
            document, self._open = self._open, None
            self.add(document)

    def add(self, tokens, pinned: bool = False) -> None:
        """Index one document (a prompt with its output, or a corpus: pinned)."""
        document = [int(t) for t in tokens][-self.max_tokens:]
        if not document:
            return
        self._documents.append((document, pinned))
        self.index.extend(document)
        self.index.end_document()
        if len(self.index) > self.max_tokens:
            self._evict()

    def _evict(self) -> None:
        """Forget the oldest generations until three quarters of the budget are used; rebuild the index."""
        used = len(self.index)
        kept: deque = deque()
        while self._documents:
            document, pinned = self._documents.popleft()
            if pinned or used <= self.max_tokens * 3 // 4:
                kept.append((document, pinned))
            else:
                used -= len(document) + 1
        self._documents = kept
        self.index = SuffixIndex()
        for document, _ in kept:
            self.index.extend(document)
            self.index.end_document()

    def checkpoint(self) -> tuple:
        """The memory as it is now, for restore(): measurement runs (calibration, sweeps, the lossless check)
        must leave the session's memory as they found it."""
        return list(self._documents), self._open, set(self._corpora), self.index, len(self.index)

    def restore(self, checkpoint: tuple) -> None:
        """Forget what was remembered since checkpoint() (the index cut back, or rebuilt where documents
        were evicted meanwhile)."""
        documents, open_document, corpora, index, length = checkpoint
        self._documents, self._open, self._corpora = deque(documents), open_document, set(corpora)
        if self.index is index and len(index) >= length:
            index.truncate(length)
            return
        self.index = SuffixIndex()
        for document, _ in self._documents:
            self.index.extend(document)
            self.index.end_document()

    def clear(self) -> None:
        """Forget everything (corpus files are read again by the next generation that names them)."""
        self.index = SuffixIndex()
        self._documents.clear()
        self._open = None
        self._corpora.clear()
        self.begun_with = []

    def load_corpus(self, path: str, tokenizer) -> None:
        """Index a text file once per session (tokenized by the target's tokenizer; the corpora's share of the
        budget is half of it, beyond which a file is cut, with a warning that says so). A file over
        MAX_CORPUS_BYTES, not UTF-8 or not a regular file is refused."""
        key = str(Path(path).resolve())
        if key in self._corpora:
            return
        text = bounded.read_text(path, "suffix corpus", MAX_CORPUS_BYTES)
        room = self.max_tokens // 2 - sum(len(d) + 1 for d, pinned in self._documents if pinned)
        if text.strip() and room > 1:
            tokens = _encode_corpus(tokenizer, text)
            if len(tokens) > room - 1:
                warnings.warn(f"suffix corpus {path}: indexed its first {room - 1} of {len(tokens)} tokens "
                              f"(corpora hold at most half of the memory's {self.max_tokens} tokens)",
                              SpecplayWarning, stacklevel=2)
            self.add(tokens[:room - 1], pinned=True)
        self._corpora.add(key)


def _encode_corpus(tokenizer, text: str) -> list:
    """A corpus's tokens, without transformers' warning that they exceed the model's context: a corpus is
    not a prompt."""
    try:
        return tokenizer.encode(text, verbose=False)
    except TypeError:  # a tokenizer without transformers' verbose flag
        return tokenizer.encode(text)


class SuffixDrafter(Drafter):
    name = "suffix"
    drafts_on_host = True

    def __init__(self, memory: SuffixMemory, tree_nodes: int):
        self.memory = memory
        self.budget = tree_nodes
        self.own = SuffixIndex()  # this generation: prompt and output so far

    def start(self, state: DecodeState, start: DraftStart) -> None:
        self.own = SuffixIndex()
        self.own.extend(state.tokens)
        self.memory.begin(self.own.tokens)

    def propose(self, state: DecodeState, k: int) -> Draft:
        tokens, parents = best_draft((self.own, self.memory.index), state.tokens, k, self.budget,
                                     state.vocab_size)
        if not tokens:
            return Draft(tokens=torch.empty(0, dtype=torch.long))  # on the host, as a tree's (see Draft)
        tokens, parents = as_tensors(tokens, parents)
        return Draft(tokens=tokens, parents=parents)

    def commit(self, state: DecodeState, commit: RoundCommit) -> None:
        self.own.extend(state.tokens[len(self.own):])


def best_draft(indexes, tokens: list, k: int, budget: int, vocab: int) -> tuple:
    """The draft for the context `tokens`: of every index's candidate trees, the one that expects the most
    accepted tokens, as (tokens, parents); ([], []) when no index has a match."""
    context = tokens[-MAX_MATCH:]
    best = ([], [], 0.0)
    for index in indexes:
        for tree in candidate_trees(index, context, k, budget, vocab):
            if tree[2] > best[2]:
                best = tree
    return best[0], best[1]


def generations_replay(generations: list, nodes_for, vocab: int):
    """K -> (drafted nodes, accepted) of every round greedy suffix decoding runs over `generations`, each
    (documents its session's index held as it began, prompt ids, output) replayed with the node budget
    nodes_for(K) (engine.methods.registry.node_budget) (engine.analysis.predict.Trace.replay)."""
    def rounds(k: int) -> list:
        nodes = nodes_for(k)
        return [r for documents, ids, output in generations
                for r in replay(documents, ids, output, k, nodes, vocab)]

    return rounds


def memory_fingerprint(documents: list, vocab: int) -> dict:
    """What a trace header keeps of the documents a suffix generation's memory held as it began (their count,
    their tokens' count and a digest, and the vocabulary its drafts were cut to), so that whoever holds the
    session's earlier generations can tell whether they rebuild that memory exactly (memory_from_generations)
    without the header carrying up to a million tokens."""
    digest = hashlib.sha256()
    for document in documents:
        digest.update(len(document).to_bytes(8, "little"))
        digest.update(array("q", document).tobytes())
    return {"documents": len(documents), "tokens": sum(len(d) for d in documents),
            "sha256": digest.hexdigest(), "vocab": int(vocab)}


def memory_from_generations(earlier: list, fingerprint) -> Optional[list]:
    """The documents a suffix generation began with, rebuilt from the session's earlier suffix generations
    (each a (prompt ids, output) pair, in the order they ran): the last ones, as many as the header's
    fingerprint counts, where their digest is the fingerprint's. None where the memory held anything else (a
    corpus file, generations before these, a document cut to the memory's budget) or the header has no
    fingerprint."""
    if not isinstance(fingerprint, dict):
        return None
    count, vocab = fingerprint.get("documents"), fingerprint.get("vocab")
    if not (isinstance(count, int) and isinstance(vocab, int) and 0 <= count <= len(earlier)):
        return None
    try:
        documents = [[int(t) for t in list(ids) + list(output)]
                     for ids, output in earlier[len(earlier) - count:]]
    except (TypeError, ValueError):
        return None
    return documents if memory_fingerprint(documents, vocab) == fingerprint else None


def replay(documents: list, prompt_ids: list, output: list, k: int, budget: int, vocab: int) -> list:
    """(drafted nodes, accepted) of each round suffix decoding runs for `output` with K, greedy: the session's
    index held `documents` when the generation began (SuffixMemory.begun_with), its own index the prompt and
    the output so far, and greedy verification accepts the tree's path that the output follows."""
    memory = SuffixIndex()
    for document in documents:
        memory.extend(document)
        memory.end_document()
    own = SuffixIndex()
    own.extend(prompt_ids)
    position, rounds = 0, []
    while position < len(output):
        tokens, parents = best_draft((own, memory), own.tokens, k, budget, vocab)
        accepted = _path_followed(tokens, parents, output[position:])
        own.extend(output[position:position + accepted + 1])
        position += accepted + 1
        rounds.append((len(tokens), accepted))
    return rounds


def _path_followed(tokens: list, parents: list, text: list) -> int:
    """How far `text` follows a path of the tree from its root (siblings are distinct tokens)."""
    node, depth = -1, 0
    while depth < len(text):
        token = text[depth]
        node = next((i for i, parent in enumerate(parents) if parent == node and tokens[i] == token), None)
        if node is None:
            break
        depth += 1
    return depth
