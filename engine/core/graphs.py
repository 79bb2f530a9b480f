"""The shared machinery of captured graphs: a round as one CUDA graph that feeds itself on the device
(RoundGraph, ChainRoundGraph; plain decoding's PlainRoundGraph and a host-drafted tree's
HostTreeRoundGraph), and draft chains captured as one graph each (CapturedChain, ChainGraphs). Each
method's own graphs live in engine/methods/<name>/graphs.py and build on these.

A whole round as one CUDA graph that feeds itself on the device: Medusa's, EAGLE's chain, the draft
model's chain and plain decoding's step.

A round queued behind an unread one (SpeculativeDecoder._launch_after) can need nothing from the host: the
last round's outcome (accepted count, path, next token), what the drafter made of its block (Medusa: the
heads' drafts from every row; EAGLE: the block's features, to feed its head) and the block's start are on the
device. Queued op by op, a Medusa round is some forty launches and copies, and on the shipped pair the host's
share of them took twice a plain round. Captured (greedy, or sampled with the round's uniforms copied in), a
round is one replay (a chain's: two, its drafting first, so that the round's clock times the phases apart):

  Medusa: 1. the last block keeps its accepted path in the target's cache (its rows moved down on the
  device); 2. the new block: the last next token, then the accepted row's tree; 3. the target's step over the
  block (decode path), the tree verification, the event's readout; 4. the heads' drafts from every row of the
  new block.
  EAGLE (a chain of K): 1. the head reads the last block's K+1 rows (features, each row's next token) at its
  true length; the rows past the accepted ones are stray, and the chain, drafted from the last accepted row's
  prediction, writes over them; 2. the block [next token] + chain after the accepted path (a chain keeps its
  prefix in place); 3. as Medusa's.
  The draft model (a chain of K): its forward over two rows after its valid prefix, its chain, then 2. and 3.
  Plain decoding: the last next token's step, its verification (the argmax, or a sample) and the readout.
  Then the outcome, the drafts or features and the new starts become the next replay's inputs (the graph's own
  buffers).

The buffers are seeded from a round that ran without the graph (seed) before the first replay after it.
EAGLE's head reads K+1 rows where a round launched apart reads the accepted ones only, so its products may
round differently there; the verification keeps the output lossless either way.

Draft chains captured as one CUDA graph each: the draft model's K steps, EAGLE's K head steps, and on the
decode path each one's whole round (the forward over what was committed since its last round, then the chain).

Drafting K tokens eagerly costs K step replays plus, per step, the argmax, the next input's embedding (EAGLE:
the fusion of feature and token) and a handful of copies, each a launch and some Python: on the shipped pair
that is most of a round. A chain graph queues all of it with one replay. A sampled chain is captured too where
the sampling kernels are the CUDA ones (they take the round's uniforms from a device buffer, no host work).

A chain graph is specific to (K, the attention width kv); it writes K-1 cache rows after `start`, which it
reads from a device buffer, so one graph serves every cache length up to kv - K. A round graph is specific to
(feed length n, K) and reads its start on the device on the decode path: one serves every cache length.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, Optional

import numpy as np
import torch
import torch.nn.functional as F

from engine.kernels.step import chain_block_reference, chain_commit_reference, keep_path_reference
from engine.models.runner import captured, fill_unknown, fit_vocab, graph_capture, to_device, warm_up_stream

CHAIN_GRAPHS_KEPT = 96  # per drafter; past this, new shapes draft eagerly (a draft model's round at K: K + 1)


class CapturedChain:
    """fn(static inputs...) -> a tensor or a tuple of tensors, captured once; run() copies new inputs in,
    replays, and returns clones of the outputs."""

    def __init__(self, fn: Callable, inputs: tuple, device: torch.device, pool):
        self.inputs = inputs
        self.fn = fn  # keeps alive every tensor the graph reads that fn's closure holds (a tree's index, say)
        with warm_up_stream(device):
            fn(*inputs)  # warm-up outside the capture (cuBLAS workspaces, lazy kernels)
        self.graph = torch.cuda.CUDAGraph()
        with graph_capture(self.graph, pool, device):
            self.outputs = fn(*inputs)

    def run(self, *values) -> torch.Tensor:
        """values: one per static input, a tensor (copied in), an int (filled in) or None (left as is)."""
        for buffer, value in zip(self.inputs, values):
            if value is None:
                continue
            if isinstance(value, int):
                buffer.fill_(value)
            else:
                buffer.copy_(value)
        self.graph.replay()
        if isinstance(self.outputs, tuple):  # the pool is shared with other graphs of the runner: copy out
            return tuple(None if t is None else t.clone() for t in self.outputs)
        return self.outputs.clone()


def one_step(runner, x: torch.Tensor, start: torch.Tensor, kv: int):
    """One token through the runner at cache row `start` (device [1]) -> (feature [1, H], logits [1, V])."""
    depth, block_visible = runner.chain_block(1)
    return runner.block_step(x, start, depth, block_visible, kv)


class ChainGraphs:
    """The captured chains of one runner, by (K, kv, ...), kept on the runner so that every generation (each
    builds its own drafter) reuses them. `available` says whether capture applies."""

    def __init__(self, runner=None):
        self.runner = runner  # whose memory pool the graphs record into (dropped after a failed capture)
        self._graphs: Dict[tuple, CapturedChain] = {}
        self._failed: set = set()  # keys whose capture failed: their rounds run without a graph

    @classmethod
    def of(cls, runner) -> "ChainGraphs":
        graphs = getattr(runner, "chain_graphs", None)
        if graphs is None:
            graphs = runner.chain_graphs = cls(runner)
        return graphs

    def __len__(self) -> int:
        return len(self._graphs)

    @staticmethod
    def available(runner, k: int, sampling=None) -> bool:
        """Chains of 2 or more on a Llama-family runner that replays graphs; sampled ones only with the CUDA
        kernels (their launches have no host work inside; the torch reference's sampling does)."""
        if sampling is not None and not sampling.backend.compiles_kernels:
            return False
        return (k > 1 and runner.device.type == "cuda" and getattr(runner, "use_graphs", False)
                and hasattr(runner, "block_step"))

    @staticmethod
    def rounds_available(runner, sampling=None) -> bool:
        """Whether a drafter's whole round (its forward over the committed tokens, then a chain of any K, 1
        included) can be one graph: as for chains."""
        return ChainGraphs.available(runner, 2, sampling)

    def get(self, key: tuple, build: Callable[[], CapturedChain]) -> Optional[CapturedChain]:
        if key not in self._graphs:
            if len(self._graphs) >= CHAIN_GRAPHS_KEPT or key in self._failed:
                return None
            graph = captured(self.runner, build, key[0])
            if graph is None:  # not tried again: a capture that failed twice would fail every round
                self._failed.add(key)
                return None
            self._graphs[key] = graph
        return self._graphs[key]


class ChainSampling:
    """How a sampled chain draws: warped by the run's settings, inverse-CDF with the round's uniforms."""

    def __init__(self, backend, temperature: float, top_k: int, top_p: float):
        self.backend = backend
        self.key = (temperature, top_k, top_p)

    def draw(self, logits: torch.Tensor, uniform: torch.Tensor):
        """logits [1, V], uniform [1] -> (token [1], q [1, V])."""
        q = self.backend.warp_probs(logits, *self.key)
        return self.backend.sample_from_probs(q, uniform), q


def chain_sampling(state) -> Optional[ChainSampling]:
    """None for greedy drafting, else the run's warp settings and backend."""
    s = state.config.sampling
    return None if s.greedy else ChainSampling(state.backend, s.temperature, s.top_k, s.top_p)


def draw_chain_token(logits: torch.Tensor, vocab: int, sampling: Optional[ChainSampling], uniforms, i: int):
    """Token i of a chain from logits [1, V']: argmax (greedy, q None) or a sample with its q [1, V]."""
    logits = fit_vocab(logits, vocab)  # a draft with a smaller vocabulary gives the target's other ids q = 0
    if sampling is None:
        return logits.argmax(-1), None
    return sampling.draw(logits, uniforms[i:i + 1])


def stack_drafts(tokens: list, probs: list) -> tuple:
    return torch.cat(tokens), (None if probs[0] is None else torch.cat(probs))  # [k], [k, V] or None


def graph_pool(runner):
    """The runner's memory pool for captured graphs (made on first use)."""
    if runner.pool_handle is None:
        runner.pool_handle = torch.cuda.graph_pool_handle()
    return runner.pool_handle


def model_chain_steps(runner, logits: torch.Tensor, row: torch.Tensor, k: int, kv: int, vocab: int,
                 sampling: Optional[ChainSampling], u: torch.Tensor):
    """k tokens of a model's chain: token 0 drawn from logits [1, V], token i after one step on token i-1 at
    cache row row + i - 1 (row: [1] on the device). Returns (tokens [k], q [k, V] or None)."""
    token, q = draw_chain_token(logits, vocab, sampling, u, 0)
    tokens, probs = [token], [q]
    for i in range(1, k):
        _, logits = one_step(runner, F.embedding(token, runner.embed_weight), row + i - 1, kv)
        token, q = draw_chain_token(logits, vocab, sampling, u, i)
        tokens.append(token)
        probs.append(q)
    return stack_drafts(tokens, probs)


def capture_feed_lengths(runner, k: int, rows: int, graph_of: Callable[[int], object]) -> int:
    """graph_of(n) for every feed length n = 1..k+1 a round at K can have; how many exist. None are made when
    the captures' warm-ups, which write `rows` rows past the cache's end, would not fit."""
    if runner.length + rows > runner.max_length:
        return 0
    return sum(graph_of(n) is not None for n in range(1, k + 2))


# Decided (the losing arms are at tag before-house-cleanup):
# - sampled chain and plain rounds are replayed too: a sampled K sweep had stopped on an illegal address on an
#   H200 while kernel scratch was made inside captures; with engine.models.runner.capture_stream the same
#   sweep ran to the end (docs/measurements/ksweep_gpu_t08_sampled_replays.txt);
# - a round's bookkeeping (a chain's or Medusa's block: its tokens, start and embeddings; the outcome copied
#   into the next replay's inputs; n-gram's cut at its count and its history's append; a tree's accepted
#   path kept in the cache) runs in one kernel each (kernels/round_kernels.cu) where the target has the
#   decode kernels and the verification is the CUDA backend's, else in their torch twins;
# - a greedy round's verification, readout and commit are launched programmatically behind the kernel before
#   them (engine.kernels.pdl: each starts while that one finishes);
# - a greedy chain round's verification, n-gram's cut and the readout are one launch (backend.greedy_readout;
#   plain decoding's argmax and readout too).


def ends_in_kernel(target, kernels, rows: int) -> bool:
    """Whether the target's step of `rows` rows ends in a step kernel (its LM head in sp_gemv) where the
    round's kernels run (kernels: round_kernels'), so the verification may start early behind it."""
    return kernels is not None and getattr(target, "step_ends_in_kernel", lambda n: False)(rows)


def chained(programmatic: bool) -> dict:
    """The CUDA backend's launch option, given only where it holds (backends wrapped by the tests take the
    reference's arguments)."""
    return {"chained": True} if programmatic else {}


def round_kernels(target, backend):
    """The target's step kernels where a round's bookkeeping runs on them, else None."""
    kernels = getattr(target, "decode_kernels", None)
    if kernels is not None and getattr(backend, "compiles_kernels", False):
        return kernels
    return None


class RoundGraph:
    """A captured round: replay() runs it; its outputs (tokens [N+1] of the block, features, logits,
    result, values: the readout) are static tensors that the next replay overwrites. Subclasses set the
    buffers and `depth` (the longest path a round can accept) and call _capture(round_)."""

    depth: int
    nodes: int
    parents: Optional[torch.Tensor] = None  # [N] host, a tree's; None for a chain
    # the readout ends with the count of the chain's real tokens (SpeculativeDecoder._read_round cuts to it)
    counts_drafts = False

    @property
    def rows(self) -> int:
        return self.nodes + 1

    def _capture(self, target, round_, draft_=None) -> None:
        """Capture round_ on CUDA; elsewhere replay() runs it eagerly (what the CPU tests drive). draft_: the
        round's drafting, captured as a graph of its own that replay_draft() runs first, so that the round's
        clock times drafting and verification apart (round_ reads what draft_ left in self.drafted)."""
        self._round, self._draft_round = round_, draft_  # keeps alive what the graphs read
        device = target.device
        self.fed_by = None  # the launched round whose outcome the buffers hold (see seed)
        self.graph = self.draft_graph = None
        if device.type != "cuda":
            return
        with warm_up_stream(device):
            if draft_ is not None:
                draft_()
            round_()  # warm-up outside the capture (cuBLAS workspaces, lazy kernels)
        if draft_ is not None:  # captured first: its outputs are the round's inputs
            self.draft_graph = torch.cuda.CUDAGraph()
            with graph_capture(self.draft_graph, graph_pool(target), device):
                draft_()
        self.graph = torch.cuda.CUDAGraph()
        with graph_capture(self.graph, graph_pool(target), device):
            self.tokens, self.features, self.logits, self.result, self.values = round_()

    def replay_draft(self, calls=None) -> None:
        """The round's drafting, when it is a graph of its own (chains); then replay() the rest. calls: the
        generation's engine.kernels.cuda_calls.StreamCalls, which launches the graph on its stream (None:
        torch's
        replay on the current stream)."""
        if self._draft_round is None:
            return
        if self.draft_graph is None:
            self._draft_round()
        else:
            launch_graph(self.draft_graph, calls)

    def replay(self, calls=None) -> None:
        if self.graph is None:
            self.tokens, self.features, self.logits, self.result, self.values = self._round()
        else:
            launch_graph(self.graph, calls)

    def _seed_outcome(self, launched) -> None:
        self.accepted.copy_(launched.result.accepted[:1])
        self.next_token.copy_(launched.next_token_on_device)
        self.start.fill_(launched.block_start)

    def draw_uniforms(self, state) -> torch.Tensor:
        """A sampled round's uniforms, drawn from the run's generator where a round launched apart draws them
        and copied in; returns the verification's on the host (the event's)."""
        uniforms = torch.rand(self.rows, generator=state.generator)
        self.verify_u.copy_(to_device(uniforms, self.target.device, torch.float32)[None])
        return uniforms


class ChainRoundGraph(RoundGraph):
    """A chain drafter's round of K, greedy or sampled (sampling: the run's ChainSampling; the draft's
    uniforms and the verification's copied in before each replay). Subclasses set up their drafter's
    buffers and give _draft(), which returns the chain (tokens [K], q [K, V] or None) from the last round's
    outcome, and _advance(), which moves their buffers on; the target's block, its verification and the
    readout are here."""

    count: Optional[torch.Tensor] = None  # [1]: how many of the chain's K tokens are real drafts (n-gram)
    # the block (tokens [K+1], start [1], x [K+1, H]) the drafting already built (n-gram's lookup kernel), or
    # None: the round builds it from the chain
    prepared: Optional[tuple] = None

    def _chain_buffers(self, target, k: int) -> None:
        device = target.device
        self.target, self.depth, self.nodes = target, k, k
        self.accepted = torch.zeros(1, dtype=torch.long, device=device)
        self.next_token = torch.zeros(1, dtype=torch.long, device=device)
        self.draft = torch.zeros(k, dtype=torch.long, device=device)  # the last block's chain
        # a start past the cache's end for the warm-up and the capture: they write only free rows
        self.start = torch.full((1,), target.length, dtype=torch.long, device=device)
        self.draft_u = torch.zeros(k, dtype=torch.float32, device=device)
        self.verify_u = torch.zeros(1, k + 1, dtype=torch.float32, device=device)

    def _capture_chain(self, target, backend, width: int, sampling) -> None:
        k = self.nodes
        depth, visible = target.chain_block(k + 1)
        kv = attention_width(target, k + 1)
        kernels = self.kernels = round_kernels(target, backend)
        block = chain_block_reference if kernels is None else kernels.chain_block
        commit = chain_commit_reference if kernels is None else kernels.chain_commit
        # programmatic launches behind kernels of ours: the greedy readout (its verification, n-gram's cut)
        # behind the step's LM head; the commit behind the readout where _advance queues nothing
        readout_pdl = ends_in_kernel(target, kernels, k + 1)  # greedy_readout: plain decoding's too
        commit_pdl = kernels is not None and type(self)._advance is ChainRoundGraph._advance

        def draft_():
            self.drafted = self._draft()  # [K], [K, V] or None

        if k == 0:  # plain decoding: nothing to draft, no graph of its own
            draft_()

        def round_():
            chain, q = self.drafted
            # the block after the accepted prefix: [next token] + chain [K+1], its start [1], x [K+1, H]
            prepared = self.prepared
            if prepared is None:
                embed = target.embed_weight
                tokens, start, x = block(self.next_token, chain, self.start, self.accepted, embed)
            else:
                tokens, start, x = prepared
            # (the first product starts early behind the block's kernel, where the round has one)
            hidden, logits = target.block_step(x, start, depth, visible, kv,
                                                after_step_kernel=kernels is not None and prepared is None)
            features = target.last_taps if target.tap_layers else hidden
            count = self.count  # n-gram's real drafts (the readout's last value, the commit's), or None
            if sampling is None:
                result, values = backend.greedy_readout(logits, chain, width, limit=count,
                                                        extra=int(count is not None), **chained(readout_pdl))
            else:
                q = None if q is None else q[None]  # None: plain decoding's empty chain
                result = backend.verify_chain_stochastic(logits[None], chain[None], q, self.verify_u,
                                                         *sampling.key)
                values = backend.readout(logits, result, chain, sampling.key[0], width,
                                         extra=int(count is not None))
            self._advance(features)
            commit(result.accepted, result.next_token, chain, start, self.accepted, self.next_token,
                   self.draft, self.start, count, None if count is None else values[-1:],
                   **chained(commit_pdl))
            return tokens, features, logits, result, values

        self._capture(target, round_, draft_ if k else None)

    def _advance(self, features: torch.Tensor) -> None:
        """The drafter's buffers for the next replay, before the outcome's are overwritten."""

    def _seed_chain(self, launched) -> None:
        self._seed_outcome(launched)
        drafted = launched.draft.tokens
        self.draft[:drafted.numel()].copy_(drafted)

    def draw_uniforms(self, state) -> torch.Tensor:
        self.draft_u.copy_(state.uniforms(self.nodes))  # drawn first, as a round's propose draws them
        return super().draw_uniforms(state)


class PlainRoundGraph(ChainRoundGraph):
    """Plain decoding's step (an empty chain): the last next token at the next row, the target's step, the
    verification of nothing (the next token: the argmax, or a sample with the round's uniform) and the
    readout. Launched apart, a plain round costs the host more than a chain's replay does."""

    def __init__(self, target, backend, width: int, sampling=None):
        self._chain_buffers(target, 0)
        empty = self.draft  # [0]

        self._draft = lambda: (empty, None)
        self._capture_chain(target, backend, width, sampling)

    def seed(self, launched, drafter) -> None:
        self._seed_outcome(launched)

    def draw_uniforms(self, state) -> torch.Tensor:
        return RoundGraph.draw_uniforms(self, state)  # the verification's one uniform, as _verify draws it


class HostTreeRoundGraph(RoundGraph):
    """The verification of a tree drafted on the host (suffix decoding, lookahead) with a fixed node count
    (0: an empty draft), as one replay. The host knows the whole block once it has drafted: the block's
    start, its tokens (the last committed one, then the tree's), the tree's parents, depths and ancestor
    mask, and a sampled round's uniforms go to the device in one copy (upload); the target's step, the tree
    verification, the readout and the cache's compaction to the accepted path (keep_path) run captured.
    Queued op by op, this round's host work is several times the GPU's (some forty torch calls, each
    tree shape's masks built and copied, a pageable copy of the parents). The outputs are static: the next
    replay overwrites them, so a host tree is one round in flight (its next draft needs this outcome
    anyway)."""

    RING = 4  # pinned upload buffers, handed out in turn (a buffer comes back after its round was read)

    def __init__(self, target, nodes: int, backend, width: int, warp: Optional[tuple] = None):
        """warp: (temperature, top_k, top_p) for sampled rounds (one-hot q: the host's drafts are
        deterministic), None for greedy ones."""
        device, n, rows = target.device, nodes, nodes + 1
        self.target, self.nodes, self.depth = target, n, n  # depth: the longest path a round can accept
        self.width = width  # the readout's top alternatives per row
        self._ints = 3 * n + 3  # [start, tokens (N+1), parents (N), depths (N+1)] int64
        ints_bytes, floats_bytes = 8 * self._ints, 4 * rows
        size = -(-(ints_bytes + floats_bytes + rows * rows) // 8) * 8
        self.upload_bytes = torch.zeros(size, dtype=torch.uint8, device=device)
        ints = self.upload_bytes[:ints_bytes].view(torch.int64)
        start, tokens = ints[:1], ints[1:1 + rows]  # [1], [N+1]
        parents, block_depth = ints[1 + rows:1 + rows + n], ints[1 + rows + n:]  # [N], [N+1]
        floats = self.upload_bytes[ints_bytes:ints_bytes + floats_bytes]
        uniforms = floats.view(torch.float32)[None]  # [1, N+1]
        mask_at = ints_bytes + floats_bytes
        visible = self.upload_bytes[mask_at:mask_at + rows * rows].view(torch.bool).view(rows, rows)
        # the warm-up and the capture run a chain at the cache's end: only free rows are written
        start.fill_(target.length)
        block_depth.copy_(target.row_indices(rows))
        parents.copy_(target.row_indices(n) - 1)
        visible.copy_(torch.ones(rows, rows, dtype=torch.bool, device=device).tril())
        self._host = [torch.zeros(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
                      for _ in range(self.RING)]
        self._views = [upload_views(buffer, self._ints, rows) for buffer in self._host]
        self._turn = 0
        kv = attention_width(target, rows)
        node_rows = target.row_indices(n)  # [N]
        # greedy: the verification behind the step's LM head, the readout behind it, programmatic launches
        pdl = chained(ends_in_kernel(target, round_kernels(target, backend), rows) and warp is None and n > 0)

        def round_():
            x = F.embedding(fill_unknown(tokens, target.vocab_size, target.input_fill), target.embed_weight)
            hidden, logits = target.block_step(x, start, block_depth, visible, kv)  # [N+1, H], [N+1, V]
            if warp is None:
                result = backend.verify_tree_greedy(logits[None], tokens[None, 1:], parents, **pdl)
            else:
                result = backend.verify_tree_stochastic(logits[None], tokens[None, 1:], parents, None,
                                                        uniforms, *warp)
            temperature = 1.0 if warp is None else warp[0]
            values = backend.readout(logits, result, tokens[1:], temperature, width, **pdl)
            if n:  # the accepted path moves down behind the last committed token (the decoder rolls back)
                keep_path(target, start, result.path[0], node_rows)
            return tokens, hidden, logits, result, values

        self._capture(target, round_)

    def upload(self, calls, start: int, last_token: int, tokens: list, parents: list, uniforms=None) -> None:
        """Queue the round's inputs: the block at cache row start, [last_token] + tokens, the tree's parents
        (-1 = the last committed token, topological order) and a sampled round's uniforms [N+1]."""
        n = self.nodes
        if len(tokens) != n or len(parents) != n:
            raise ValueError(f"a tree of {n} nodes needs {n} tokens and parents, got {len(tokens)}, "
                             f"{len(parents)}")
        block_depth, visible = tree_shape(tuple(parents))
        host = self._host[self._turn]
        ints, floats, mask = self._views[self._turn]
        self._turn = (self._turn + 1) % self.RING
        ints[0], ints[1] = start, last_token
        ints[2:2 + n] = tokens
        ints[2 + n:2 + 2 * n] = parents
        ints[2 + 2 * n:] = block_depth
        mask[:] = visible
        if uniforms is not None:
            floats[:] = uniforms.numpy()
        if calls is None:
            self.upload_bytes.copy_(host, non_blocking=True)
        else:
            calls.copy_to_device(self.upload_bytes, host)


def upload_views(buffer: torch.Tensor, ints: int, rows: int) -> tuple:
    """numpy views of a pinned upload buffer: (int64 [ints], float32 [rows], uint8 [rows * rows])."""
    array = buffer.numpy()
    floats_at, mask_at = 8 * ints, 8 * ints + 4 * rows
    return (array[:floats_at].view("int64"), array[floats_at:mask_at].view("float32"),
            array[mask_at:mask_at + rows * rows])


@functools.lru_cache(maxsize=1024)
def tree_shape(parents: tuple) -> tuple:
    """A host tree's verification block (row 0 the last committed token, row i + 1 node i): (depths
    [N+1], ancestor-or-self mask [(N+1) * (N+1)] as 0/1 bytes, row-major). Tree shapes repeat: each is built
    once."""
    rows = len(parents) + 1
    depths, seen = [0], [{0}]
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"tree parents must be topologically ordered (-1 <= parents[i] < i); "
                             f"parents[{i}] = {parent}")
        depths.append(depths[parent + 1] + 1)
        seen.append(seen[parent + 1] | {i + 1})
    mask = np.array([j in row for row in seen for j in range(rows)], dtype=np.uint8)
    return np.array(depths, dtype=np.int64), mask


def launch_graph(graph, calls) -> None:
    if calls is None:
        graph.replay()
    else:
        calls.launch(graph)


def attention_width(runner, rows: int) -> int:
    """The attention width a round's step of `rows` rows is built for: 0 on the decode path (it reads the
    block's start on the device), else the whole cache (the mask hides what lies past the block)."""
    return 0 if runner.decode_path(rows) else runner.max_length


def keeps_path_in_kernel(target, path: torch.Tensor) -> bool:
    """Whether keep_path moves this path in sp_keep_path."""
    kernels = getattr(target, "decode_kernels", None)
    return kernels is not None and kernels.takes_path(target.kv, path)


def keep_path(target, start: torch.Tensor, path: torch.Tensor, rows: torch.Tensor) -> None:
    """The tree block at cache row start (device [1]; its row 0 the last committed token) keeps its accepted
    path: rows start+1+i take rows start+1+path[i] (path [D], -1 past the accepted count; rows = arange(D)).
    sp_keep_path where the target has the decode kernels, else keep_path_reference."""
    if keeps_path_in_kernel(target, path):
        target.decode_kernels.keep_path(target.kv, start, path)
    else:
        keep_path_reference(target.kv, start, path, rows)


def plain_round_graph(target, backend, width: int, sampling=None) -> Optional[PlainRoundGraph]:
    """Plain decoding's captured step, built on first use and kept with the target's graphs; None where it
    does not apply (as for Medusa's)."""
    applies = ChainGraphs.available(target, 2, sampling) and backend.compiles_kernels
    if not (applies and target.decode_path(1)):
        return None
    if target.length + 2 > target.max_length:
        return None
    key = ("plain_round", width, None if sampling is None else sampling.key)
    return ChainGraphs.of(target).get(key, lambda: PlainRoundGraph(target, backend, width, sampling))


def model_round_applies(runner, target, k: int, backend, runner_rows: int, sampling) -> bool:
    """Whether a chain round at K drafted by a model runner (stepping runner_rows rows first) is captured:
    graphs and compiled kernels, the decode path for both blocks, and free cache rows for the capture."""
    rows = k + 1
    return (ChainGraphs.available(target, 2) and backend.compiles_kernels and target.decode_path(rows)
            and runner.decode_path(runner_rows) and ChainGraphs.available(runner, 2)
            and target.length + 1 + k + rows <= target.max_length)


def host_tree_round_graph(target, nodes: int, backend, width: int, warp: Optional[tuple] = None
                          ) -> Optional[HostTreeRoundGraph]:
    """The captured verification of a host-drafted tree of `nodes` nodes, built on first use and kept with
    the target's graphs; None where it does not apply (as for Medusa's, a tapped target too: its features
    would be the taps), and where the block does not fit after the cache's end."""
    rows = nodes + 1
    if not (ChainGraphs.available(target, 2) and backend.compiles_kernels and target.decode_path(rows)
            and getattr(target, "takes_device_starts", False)) or getattr(target, "tap_layers", ()):
        return None
    if target.length + rows > target.max_length:
        return None
    key = ("host_tree_round", nodes, width, warp)
    return ChainGraphs.of(target).get(key, lambda: HostTreeRoundGraph(target, nodes, backend, width, warp))
