"""The training corpus's most frequent continuations, for n-gram prompt lookup where the context has none.

Prompt lookup proposes nothing when the last token never occurred earlier in the context (28% of
its rounds on the shipped pair's held-out prompts, K = 4:
scripts/ngram_table_replay.py, at tag before-house-cleanup), and fewer
than K tokens when its match sits at the end.
This table fills those slots: after a token `last` (preceded by `prev`), the continuation the corpus's
counts make most likely, one token at a time (each next token the most frequent after the last two, else
after the last one). It holds, for every token, the continuation after it alone, and, for the pairs
(prev, last) where knowing `prev` changes the first token most often, the continuation after the pair.
Drafts stay one-hot and verification decides, so the output is the same with or without it.

The file sits beside the target's tokenizer (its ids are the table's) and names that tokenizer's sha256:
a table made for another tokenizer is not loaded.
"""
from __future__ import annotations

import hashlib
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import torch

from engine.errors import SpecplayWarning

TABLE_FILE = "ngram_table.safetensors"
WIDTH = 4  # tokens per continuation
PAIRS = 1000  # (prev, last) pairs kept


@dataclass
class CorpusTable:
    chain: torch.Tensor  # [V, W] int64: the continuation after each token, -1 past its end
    pair_keys: torch.Tensor  # [P] int64, ascending: prev * V + last
    pair_tokens: torch.Tensor  # [P, W] int64: the continuation after (prev, last), -1 past its end
    metadata: dict
    _rows: Optional[tuple] = field(default=None, repr=False, compare=False)  # _host_rows, made on first use

    @property
    def vocab(self) -> int:
        return self.chain.shape[0]

    @property
    def width(self) -> int:
        return self.chain.shape[1]

    def to(self, device) -> "CorpusTable":
        return CorpusTable(self.chain.to(device), self.pair_keys.to(device), self.pair_tokens.to(device),
                           self.metadata)

    def continuation(self, tokens: list, m: int) -> list:
        """Up to m tokens after `tokens` (a context of at least one token; only its last two are read): the
        pair's row where (tokens[-2], tokens[-1]) has one, else the last token's, cut at its first -1."""
        if m <= 0 or not tokens or not 0 <= tokens[-1] < self.vocab:
            return []
        rows = self._host_rows()
        row = None
        if len(tokens) >= 2 and 0 <= tokens[-2] < self.vocab:
            row = rows[1].get(tokens[-2] * self.vocab + tokens[-1])
        row = rows[0][tokens[-1]] if row is None else row
        out = []
        for token in row[:m]:
            if token < 0:
                break
            out.append(token)
        return out

    def _host_rows(self) -> tuple:
        """(chain rows as lists, {pair key: row}), made once: the host drafter looks up every round."""
        if self._rows is None:
            chain = self.chain.cpu().tolist()
            pairs = dict(zip(self.pair_keys.cpu().tolist(), self.pair_tokens.cpu().tolist(), strict=True))
            self._rows = (chain, pairs)
        return self._rows

    def save(self, path: Path) -> None:
        """int16 ids (int32 pair keys) where they fit: the shipped family has a size budget."""
        from safetensors.torch import save_file

        small = self.vocab <= 32767
        key_small = self.vocab * self.vocab < 2 ** 31
        save_file({"chain": self.chain.to(torch.int16 if small else torch.int32),
                   "pair_keys": self.pair_keys.to(torch.int32 if key_small else torch.int64),
                   "pair_tokens": self.pair_tokens.to(torch.int16 if small else torch.int32)},
                  str(path), metadata={k: str(v) for k, v in self.metadata.items()})


def tokenizer_sha256(model_dir: Path) -> Optional[str]:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load(model_dir) -> Optional[CorpusTable]:
    """The table beside a model's tokenizer, or None: no file, or one that cannot serve (unreadable,
    truncated, malformed, made for another tokenizer), which is said in a warning: prompt lookup then runs
    without it, as with no file."""
    from safetensors import safe_open

    path = Path(model_dir) / TABLE_FILE
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name).long() for name in ("chain", "pair_keys", "pair_tokens")}
    except Exception as exc:  # safetensors raises its own errors for a truncated or foreign file
        return _left_out(path, f"unreadable ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})")
    if metadata.get("tokenizer_sha256") != tokenizer_sha256(model_dir):
        return _left_out(path, "made for another tokenizer")
    chain, keys, rows = tensors["chain"], tensors["pair_keys"], tensors["pair_tokens"]
    if chain.dim() != 2 or keys.dim() != 1 or rows.shape != (keys.numel(), chain.shape[1]):
        return _left_out(path, "its tensors have the wrong shapes")
    return CorpusTable(chain, keys, rows, metadata)


def _left_out(path: Path, why: str) -> None:
    warnings.warn(f"n-gram corpus table {path} {why}: prompt lookup runs without it", SpecplayWarning,
                  stacklevel=3)
    return None


def build(sequences: Iterable[list], vocab: int, width: int = WIDTH, pairs: int = PAIRS,
          metadata: Optional[dict] = None) -> CorpusTable:
    """The table of token-id sequences (the training split): counts of the next token after each token and
    after each pair, then the continuations they make most likely. Ties go to the lower id."""
    after_one: dict = defaultdict(Counter)  # last -> next counts
    after_two: dict = defaultdict(Counter)  # (prev, last) -> next counts
    tokens = 0
    for ids in sequences:
        tokens += len(ids)
        for a, b in zip(ids, ids[1:]):
            after_one[a][b] += 1
        for a, b, c in zip(ids, ids[1:], ids[2:]):
            after_two[(a, b)][c] += 1
    best_one = {a: _most_common(c) for a, c in after_one.items()}
    best_two = {key: _most_common(c) for key, c in after_two.items()}

    def walk(context: list) -> list:
        out, seq = [], list(context)
        while len(out) < width:
            token = best_two.get((seq[-2], seq[-1])) if len(seq) >= 2 else None
            token = best_one.get(seq[-1]) if token is None else token
            if token is None:
                break
            out.append(token)
            seq.append(token)
        return out + [-1] * (width - len(out))

    chain = torch.full((vocab, width), -1, dtype=torch.long)
    for a in best_one:
        if 0 <= a < vocab:
            chain[a] = torch.tensor(walk([a]))
    # the pairs whose own first token beats the last token's row most often over the corpus
    gains = []
    for (a, b), counts in after_two.items():
        if not (0 <= a < vocab and 0 <= b < vocab):
            continue
        first = best_two[(a, b)]
        alone = int(chain[b, 0])
        gain = counts[first] - counts.get(alone, 0)
        if gain > 0:
            gains.append((-gain, a * vocab + b))
    kept = sorted(key for _, key in sorted(gains)[:pairs])
    pair_tokens = torch.tensor([walk([key // vocab, key % vocab]) for key in kept],
                               dtype=torch.long).reshape(len(kept), width)
    info = {"tokens": tokens, "contexts": len(after_one), "pairs_seen": len(after_two), "pairs": len(kept),
            "width": width, **(metadata or {})}
    return CorpusTable(chain, torch.tensor(kept, dtype=torch.long), pair_tokens, info)


def _most_common(counts: Counter) -> int:
    top = max(counts.values())
    return min(token for token, n in counts.items() if n == top)
