"""Layer-skip self-speculation: the target's first L layers, its final norm and LM head draft a chain of K.

No extra weights: the draft runner is a LlamaRunner over the target's own layer, embedding, norm and head
tensors (the same objects), so it works on any Llama-family model. Its KV cache is the target's: the first L
layers of the target's cache buffer, viewed. The rows of committed tokens there are exactly what the draft
would compute for them (same weights, same inputs, same positions), so the draft needs no prefill, no second
cache and no catch-up forward of the accepted tokens: before each round it adopts the target's length and
writes its own rows above it, which the verification forward then overwrites with the same layers' K/V of the
same block (chains only: the block is [last committed token] + the draft). Verification still runs all of
the target's layers; skipping the first L for the drafted rows would need a forward that starts at layer L.
"""
from __future__ import annotations

import weakref

import torch

from engine.core.graphs import ChainGraphs, chain_sampling
from engine.errors import SpecplayError
from engine.methods.base import DecodeState, Draft, DraftStart, RoundCommit
from engine.methods.draft_model.drafter import DraftModelDrafter
from engine.models.llama import LlamaRunner

# target -> {(layers, shared): runner}: a runner (and its CUDA graphs) outlives the generation that built it
_RUNNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def default_draft_layers(num_layers: int) -> int:
    """Half the target's layers, at least 1."""
    return max(1, num_layers // 2)


def resolve_draft_layers(target, requested: int) -> int:
    """The draft's layer count for this target (0 = the default); SpecplayError when it cannot be."""
    if getattr(target, "tp", 1) > 1:
        raise SpecplayError("layer skip does not run on a tensor-parallel target (--tp) yet")
    if not isinstance(target, LlamaRunner):
        raise SpecplayError("layer skip drafts with the target's own layers: it needs a Llama-family target")
    total = len(target.layers)
    if total < 2:
        raise SpecplayError("layer skip needs a target of at least 2 layers (it drafts with fewer of them)")
    layers = requested or default_draft_layers(total)
    if not 1 <= layers < total:
        raise SpecplayError(f"draft layers must be between 1 and {total - 1} for this {total}-layer target "
                            f"(got {requested})")
    return layers


class LayerSkipRunner(LlamaRunner):
    """The target's first `layers` layers as a LlamaRunner, every weight tensor the target's own object.

    Built without LlamaRunner.__init__ (which reads a checkpoint): the target's attributes are copied (the
    tensors are shared, not copied), then every piece of per-cache state gets its own instance. share_cache:
    the KV buffer is a view of the target's first layers (see the module's docstring), else its own zeros."""

    def __init__(self, target: LlamaRunner, layers: int, share_cache: bool = True):
        vars(self).update(vars(target))
        self.layers = list(target.layers[:layers])
        # [L, 2, kv_heads, max_length, D]
        self.kv = target.kv[:layers] if share_cache else torch.zeros_like(target.kv[:layers])
        self.shares_cache = share_cache
        self._length = 0
        self._start = torch.zeros(1, dtype=torch.long, device=self.device)
        self._chains, self._trees, self._graphs = {}, {}, {}  # masks and captured steps of this runner
        self._gemv_ok = {}  # decided for this runner's own layers
        self.pool_handle = None
        self.chain_graphs = None  # engine.core.graphs's captured chains, made on first use

    def adopt(self, length: int) -> None:
        """Take the first `length` rows of the shared cache as this runner's (the target's committed ones)."""
        if not self.shares_cache:
            raise ValueError("adopt() needs a cache shared with the target")
        if not 0 <= length <= self.max_length:
            raise ValueError(f"adopt({length}): the cache holds {self.max_length} rows")
        self._length = int(length)


def layer_skip_runner(target: LlamaRunner, layers: int, share_cache: bool = True) -> LayerSkipRunner:
    """The draft runner of `layers` layers for this target, kept per target so that a GPU's captured graphs
    serve every generation; it follows the target's CUDA-graph setting."""
    runners = _RUNNERS.setdefault(target, {})
    key = (layers, share_cache)
    if key not in runners:
        runners[key] = LayerSkipRunner(target, layers, share_cache)
    runner = runners[key]
    runner.use_graphs = target.use_graphs
    return runner


class LayerSkipDrafter(DraftModelDrafter):
    """A draft-model drafter whose draft model is the target's first L layers, over the target's cache."""

    name = "layerskip"

    def __init__(self, target: LlamaRunner, layers: int = 0):
        self.layers = resolve_draft_layers(target, layers)
        super().__init__(layer_skip_runner(target, self.layers))
        self.target = target

    replays_rounds = True  # a round after an unread one may be a replay of its round graph (round_graph)

    def round_graph(self, state: DecodeState, config, width: int):
        """The rounds as one self-feeding graph replay each (engine.methods.layerskip.graphs)."""
        sampling = chain_sampling(state)
        if not ChainGraphs.rounds_available(self.runner, sampling):
            return None
        from engine.methods.layerskip.graphs import layer_skip_round_graph

        return layer_skip_round_graph(self.runner, self.target, config.k, state.backend, state.vocab_size,
                                      width, sampling)

    def start(self, state: DecodeState, start: DraftStart) -> None:
        self.cached = self.target.length  # the target's prefill filled the shared rows: nothing to feed

    def propose(self, state: DecodeState, k: int) -> Draft:
        # the target's cache holds every committed token but the last (its verification rewrote the rows of
        # the accepted drafts and was rolled back): adopt it, then feed the last token and draft above it
        self.runner.adopt(self.target.length)
        self.cached = self.target.length
        return super().propose(state, k)

    def commit(self, state: DecodeState, commit: RoundCommit) -> None:
        """Nothing to roll back: the next propose adopts the target's rolled-back length."""
