"""What a generation is asked to do."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from engine import methods
from engine.errors import SpecplayError

MAX_K = 32


@dataclass(frozen=True)
class SamplingParams:
    """Target-side sampling. temperature == 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if not self.temperature >= 0.0:
            raise SpecplayError(f"temperature must be >= 0 (got {self.temperature})")
        if not 0.0 < self.top_p <= 1.0:
            raise SpecplayError(f"top-p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise SpecplayError(f"top-k must be >= 0 (got {self.top_k})")


@dataclass(frozen=True)
class GenerationConfig:
    method: str = "draft"
    k: int = 4
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    max_new_tokens: int = 128
    ngram_n: int = 3  # longest suffix the n-gram drafter tries to match
    tree_nodes: int = 0  # medusa: node budget (0 = 2K); eagle: 0 = a chain of K, N > 0 = a dynamic tree of N
    stop_at_eos: bool = True
    draft_layers: int = 0  # layerskip: target layers that draft (0 = half of the target's, at least 1)
    suffix_corpus: str = ""  # suffix: a text file indexed beside the session's history ("" = none)

    def validate(self) -> None:
        method = methods.get(self.method)  # unknown names raise here
        if not 1 <= self.k <= MAX_K:
            raise SpecplayError(f"K must be between 1 and {MAX_K} (got {self.k})")
        if self.max_new_tokens <= 0:
            raise SpecplayError(f"max-new-tokens must be > 0 (got {self.max_new_tokens})")
        if not 0 <= self.tree_nodes <= methods.MAX_TREE_NODES:
            raise SpecplayError(f"tree nodes must be between 0 and {methods.MAX_TREE_NODES} (got {self.tree_nodes})")
        if self.tree_nodes and not method.takes_tree_size:
            raise SpecplayError(f"method {self.method!r} drafts a chain and takes no tree size")
        if self.ngram_n < 1:
            raise SpecplayError(f"n-gram size must be >= 1 (got {self.ngram_n})")
        if self.draft_layers < 0:  # the upper bound depends on the target: the layerskip drafter checks it
            raise SpecplayError(f"draft layers must be >= 1, or 0 for half the target's "
                                f"(got {self.draft_layers})")
        if self.suffix_corpus:
            _check_readable_file(self.suffix_corpus, "suffix corpus")
        self.sampling.validate()

    @property
    def drafts(self) -> int:
        """Tokens drafted per round (0 for plain decoding)."""
        return 0 if self.method == "none" else self.k

    @property
    def spec(self) -> str:
        """The method as one spelling: 'eagle:8', 'draft'."""
        return str(methods.MethodSpec(self.method, self.tree_nodes))

    def with_spec(self, spec: str) -> "GenerationConfig":
        """This config with the method (and tree size) of a spec such as 'eagle:8'."""
        parsed = methods.parse_spec(spec)
        return replace(self, method=parsed.name, tree_nodes=parsed.tree_nodes)

    def to_dict(self) -> dict:
        return asdict(self)


def _check_readable_file(path: str, what: str) -> None:
    file = Path(path)
    if not file.is_file():
        raise SpecplayError(f"{what} {path!r}: no such file")
    if not os.access(file, os.R_OK):
        raise SpecplayError(f"{what} {path!r}: not readable")
