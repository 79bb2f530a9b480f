"""What a generation is asked to do."""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Optional

from engine.errors import SpecplayError
from engine.methods import registry as methods

MAX_K = 32
MIN_TEMPERATURE = 1e-4  # below it (but above 0) logits / T overflows; 0 is greedy
MAX_TEMPERATURE = 100.0  # above it the distribution is uniform noise
MAX_TOP_K = 2**31 - 1
MAX_SEED = 2**63 - 1  # torch generators take 64 bits; check-lossless adds the sample index
MAX_NEW_TOKENS = 2**24
MAX_NGRAM = 64
MAX_DRAFT_LAYERS = 1024


def check_int(name: str, value, low: int, high: int) -> None:
    """value is an integer (not a bool) in [low, high], or a SpecplayError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SpecplayError(f"{name} must be an integer (got {value!r})")
    if not low <= value <= high:
        raise SpecplayError(f"{name} must be between {low} and {high} (got {value})")


def check_real(name: str, value) -> float:
    """value as a finite float, or a SpecplayError naming it (NaN and infinities are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SpecplayError(f"{name} must be a number (got {value!r})")
    if not math.isfinite(value):
        raise SpecplayError(f"{name} must be a finite number (got {value})")
    return float(value)


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
        t = check_real("temperature", self.temperature)
        if t != 0.0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
            raise SpecplayError(f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE:g} and "
                                f"{MAX_TEMPERATURE:g} (got {self.temperature})")
        if not 0.0 < check_real("top-p", self.top_p) <= 1.0:
            raise SpecplayError(f"top-p must be in (0, 1] (got {self.top_p})")
        check_int("top-k", self.top_k, 0, MAX_TOP_K)


@dataclass(frozen=True)
class GenerationConfig:
    method: str = "draft"
    k: int = 4
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    max_new_tokens: int = 128
    ngram_n: int = 5  # longest suffix the n-gram drafter tries to match (3 before the corpus table)
    # n-gram: the target's corpus table (if any) fills what the lookup leaves; None: on the GPU only, where a
    # round costs the same whatever it drafts (on the CPU each drafted row costs verification)
    ngram_corpus: Optional[bool] = None
    tree_nodes: int = 0  # medusa: node budget (0 = 2K); eagle: 0 = a chain of K, N > 0 = a dynamic tree of N
    stop_at_eos: bool = True
    draft_layers: int = 0  # layerskip: target layers that draft (0 = half of the target's, at least 1)
    suffix_corpus: str = ""  # suffix: a text file indexed beside the session's history ("" = none)
    # a timing study: verification runs as usual but accepts as this profile says (engine.core.synthetic:
    # "3.2" a mean acceptance length, "0.9,0.8" per-position rates); "" = real verification. NOT model output
    synthetic_acceptance: str = ""

    def validate(self) -> None:
        if not isinstance(self.method, str):
            raise SpecplayError(f"method must be a name (got {self.method!r})")
        method = methods.get(self.method)  # unknown names raise here
        check_int("K", self.k, 1, MAX_K)
        check_int("max-new-tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS)
        check_int("tree nodes", self.tree_nodes, 0, methods.MAX_TREE_NODES)
        if self.tree_nodes and not method.takes_tree_size:
            raise SpecplayError(f"method {self.method!r} drafts a chain and takes no tree size")
        check_int("n-gram size", self.ngram_n, 1, MAX_NGRAM)
        check_int("seed", self.seed, 0, MAX_SEED)
        # 0 = half the target's layers; the upper bound depends on the target: the layerskip drafter checks it
        check_int("draft layers", self.draft_layers, 0, MAX_DRAFT_LAYERS)
        if self.ngram_corpus not in (None, True, False):
            raise SpecplayError(f"ngram corpus must be on, off or auto (got {self.ngram_corpus!r})")
        if not isinstance(self.suffix_corpus, str):
            raise SpecplayError(f"suffix corpus must be a file name (got {self.suffix_corpus!r})")
        if self.suffix_corpus:
            _check_readable_file(self.suffix_corpus, "suffix corpus")
        self._check_synthetic()
        if not isinstance(self.sampling, SamplingParams):
            raise SpecplayError(f"sampling must be SamplingParams (got {type(self.sampling).__name__})")
        self.sampling.validate()

    def _check_synthetic(self) -> None:
        from engine.core.synthetic import SyntheticAcceptance

        profile = SyntheticAcceptance.parse(self.synthetic_acceptance)
        if profile is not None:
            profile.check(self.k)

    @property
    def synthetic(self) -> bool:
        """Whether the accept/reject verdict follows a synthetic profile (the output is not the model's)."""
        value = self.synthetic_acceptance
        return bool(value.strip()) if isinstance(value, str) else False

    def uses_ngram_table(self, device) -> bool:
        """Whether n-gram fills its proposals from the corpus table on this device (where there is one)."""
        if self.ngram_corpus is None:
            return str(getattr(device, "type", device)).startswith("cuda")
        return self.ngram_corpus

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

    def plain(self) -> "GenerationConfig":
        """The plain decoding run this config is compared with: the same prompt settings, no drafting method
        and so no tree size (a tree method's reference run would otherwise be refused), and real verification
        (plain decoding drafts nothing for a synthetic profile to decide on)."""
        return replace(self, method="none", tree_nodes=0, synthetic_acceptance="")

    def to_dict(self) -> dict:
        return asdict(self)


def _check_readable_file(path: str, what: str) -> None:
    file = Path(path)
    if not file.is_file():
        raise SpecplayError(f"{what} {path!r}: no such file")
    if not os.access(file, os.R_OK):
        raise SpecplayError(f"{what} {path!r}: not readable")


def config_from_dict(settings: dict, events: list = ()) -> GenerationConfig:
    """The GenerationConfig of a trace header's settings; for a headerless trace, what its rounds tell."""
    values = _known(GenerationConfig, settings)
    sampling = values.pop("sampling", None) or {}
    if not settings and events:
        values = {"method": events[0].method, "k": max(1, events[0].k)}
    elif "ngram_corpus" not in settings:  # recorded before n-gram had a corpus table: it ran without one
        values["ngram_corpus"] = False
    return GenerationConfig(**values, sampling=SamplingParams(**_known(SamplingParams, sampling)))


def _known(cls, data: dict) -> dict:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}
