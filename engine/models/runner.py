"""The one interface the decoder and drafters use to run a causal LM with its own KV cache.

Two implementations: `engine.models.llama.LlamaRunner` (our compact forward over a static KV cache, Llama /
Qwen2 /
Mistral configs, trees supported) and `engine.models.hf_runner.HFRunner` (any other transformers causal LM,
chains
only).

Cache model: the cache holds `length` tokens at positions 0..length-1. `forward` appends a block of n tokens;
rolling back is moving the length; a tree block is compacted to its accepted path with `compact`.
"""
from __future__ import annotations

import contextlib
import gc
import logging
from abc import ABC, abstractmethod
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

CAPTURE_ATTEMPTS = 2  # a failed capture is retried once, in a fresh memory pool (see captured)


class ForwardOutput(NamedTuple):
    logits: torch.Tensor  # [n, V] float32
    hidden: torch.Tensor  # [n, H] last decoder layer output, before the final norm (EAGLE's "feature")
    # [n, len(taps) * H] the outputs of the runner's tap layers side by side (EAGLE-3's fused features), or
    # None when the runner taps no layer (LlamaRunner.tap_layers)
    taps: Optional[torch.Tensor] = None


class CausalRunner(ABC):
    vocab_size: int
    hidden_size: int
    max_length: int
    device: torch.device
    dtype: torch.dtype
    supports_tree: bool = False
    # The id fed in place of input ids past this model's vocabulary, or None (no check, the default). Set on a
    # draft narrower than its target, which must read every token the target emits.
    input_fill: Optional[int] = None
    # Which forward runs the model, and off the fast path why (engine.models.loading.load_runner sets it):
    # "fast path" (our compact forward) or "transformers path: <reason>".
    forward_path: str = "fast path"

    @property
    @abstractmethod
    def length(self) -> int:
        """Number of tokens in the KV cache."""

    @abstractmethod
    def reset(self) -> None:
        """Empty the cache."""

    @abstractmethod
    def forward(self, tokens: torch.Tensor, parents: Optional[torch.Tensor] = None) -> ForwardOutput:
        """Append a block of tokens [n] (int64) at the end of the cache and return their logits and features.

        parents=None: a chain (token i sits at position length+i and sees the cache and tokens 0..i).
        parents=[n] int64 in topological order: a tree; parents[i] is the index in this block of token i's
        parent, or -1 when its parent is the last cached token. Token i sits at position length+depth(i) and
        sees the cache plus its ancestors in the block. The cache grows by n either way.
        """

    @abstractmethod
    def rollback(self, length: int) -> None:
        """Forget every cached token at index >= length."""

    @abstractmethod
    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Keep cache rows start+keep[i] as rows start+i (keep: [m] int64, increasing); length becomes
        start+m.

        Used after a tree block to keep only the accepted path."""

    @abstractmethod
    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on features [n, H] -> logits [n, V] float32 (Medusa / EAGLE heads use it)."""

    @abstractmethod
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input embeddings of tokens [n] -> [n, H] (the EAGLE head uses the target's embedding)."""


def to_device(values, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list or CPU tensor on `device`, without stalling a GPU: a copy from ordinary (pageable) host
    memory waits for the copy engine, so on CUDA the values go through pinned memory asynchronously."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    host = host.to(dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def fill_unknown(tokens: torch.Tensor, vocab_size: int, fill: Optional[int]) -> torch.Tensor:
    """tokens with every id >= vocab_size replaced by fill (no-op when fill is None). tokens: [n] int64."""
    if fill is None:
        return tokens
    return tokens.masked_fill(tokens >= vocab_size, fill)


def fit_vocab(logits: torch.Tensor, width: int) -> torch.Tensor:
    """A draft's logits [n, V_draft] over the target's ids [n, width]: ids past the draft's vocabulary get
    -inf (q = 0: the draft never proposes them), ids past the target's are dropped (it cannot score them).
    The common case, equal widths, returns logits itself."""
    have = logits.shape[-1]
    if have == width:
        return logits
    if have > width:
        return logits[..., :width]
    return F.pad(logits, (0, width - have), value=float("-inf"))


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of each node of a tree block (roots, parent -1, have depth 0). parents: [n] -> [n] int64."""
    parents_list = parents.tolist()
    depths = []
    for i, p in enumerate(parents_list):
        if p >= i:
            raise ValueError("tree parents must be in topological order (parents[i] < i)")
        depths.append(0 if p < 0 else depths[p] + 1)
    return torch.tensor(depths, dtype=torch.long, device=parents.device)


def tree_ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[n, n] bool: mask[i, j] is True when node j is node i or one of its ancestors."""
    n = parents.numel()
    parents_list = parents.tolist()
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents_list):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
    return mask.to(parents.device)


_CAPTURE_STREAMS: dict = {}  # device -> the stream its graphs are warmed up and captured on


def capture_stream(device: torch.device) -> "torch.cuda.Stream":
    """One side stream per device, for the warm-up before a capture and for the capture itself. The kernels
    keep scratch per stream that they make on first use (kernels/workspaces.py: zeroed); warmed up on
    the stream the capture then uses, that scratch is made and zeroed for real, outside any graph. Made first
    inside a capture, its zeroing would be a node of that one graph, its memory that graph's pool's, and
    every other graph captured with it would depend on that graph having run (or on its capture not having
    failed)."""
    device = torch.device(device)
    key = device.index if device.index is not None else torch.cuda.current_device()
    stream = _CAPTURE_STREAMS.get(key)
    if stream is None:
        stream = _CAPTURE_STREAMS[key] = torch.cuda.Stream(torch.device("cuda", key))
    return stream


@contextlib.contextmanager
def warm_up_stream(device: torch.device):
    """Run the body on the device's capture stream, after the current stream's queued work and before its
    next (a graph's warm-up: cuBLAS handles, workspaces and lazy kernels made outside the capture)."""
    stream = capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream(device).wait_stream(stream)


@contextlib.contextmanager
def graph_capture(graph: "torch.cuda.CUDAGraph", pool, device: torch.device):
    """torch.cuda.graph on the device's capture stream, with two guards. Python's cyclic collector is held
    off: freeing a pinned host buffer inside a capture makes CUDA calls that may invalidate it
    (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, seen now and then on H200s, never in the same place twice). And
    the capture is thread-local: another thread's CUDA calls cannot invalidate it. A capture that fails
    leaves its memory pool recording (torch skips the pool's end when the capture's end raises), so its
    recording is ended here; the owner then takes a new pool (see captured)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=capture_stream(device),
                              capture_error_mode="thread_local"):
            yield
    except RuntimeError:
        _end_pool_recording(pool)
        raise
    finally:
        if collecting:
            gc.enable()


def _end_pool_recording(pool) -> None:
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None or pool is None:
        return
    try:
        end(torch.cuda.current_device(), pool)
    except RuntimeError:  # nothing was recording to it
        pass


def captured(owner, build: Callable, what: str, attempts: int = CAPTURE_ATTEMPTS):
    """build() -> a captured graph object, retried: after a failure the owner's pool (owner.pool_handle) is
    dropped, so that the retry, and every later capture of the owner, records into a new one. None after the
    last attempt: the caller runs that shape without a graph (the same results, more launches), with a
    warning, rather than failing the run."""
    for attempt in range(1, attempts + 1):
        try:
            return build()
        except RuntimeError as exc:  # torch.AcceleratorError and CuPy's CUDA errors are RuntimeErrors
            log.warning("capturing the %s graph failed (attempt %d of %d): %s", what, attempt, attempts,
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            if owner is not None:
                owner.pool_handle = None
    return None
