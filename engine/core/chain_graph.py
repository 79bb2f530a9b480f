"""Draft chains captured as one CUDA graph each: the draft model's K steps, EAGLE's K head steps, and on the
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

import os
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F

from engine.kernels.step import (
    GEMV_MAX_ROWS,
    HALF_DTYPES,
    MEDUSA_MAX_H,
    TOPK_MAX,
    gemv_fits,
    medusa_heads_reference,
    topk,
)
from engine.models.runner import captured, fill_unknown, fit_vocab, graph_capture, warm_up_stream

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


def _one_step(runner, x: torch.Tensor, start: torch.Tensor, kv: int):
    """One token through the runner at cache row `start` (device [1]) -> (feature [1, H], logits [1, V])."""
    depth, block_visible = runner._chain_block(1)
    return runner._block_step(x, start, depth, block_visible, kv)


class ChainGraphs:
    """The captured chains of one runner, by (K, kv, ...), kept on the runner so that every generation (each
    builds its own drafter) reuses them. `available` says whether capture applies."""

    def __init__(self, runner=None):
        self.runner = runner  # whose memory pool the graphs record into (dropped after a failed capture)
        self._graphs: Dict[tuple, CapturedChain] = {}
        self._failed: set = set()  # keys whose capture failed: their rounds run without a graph

    @classmethod
    def of(cls, runner) -> "ChainGraphs":
        graphs = getattr(runner, "_chain_graphs", None)
        if graphs is None:
            graphs = runner._chain_graphs = cls(runner)
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
                and hasattr(runner, "_block_step"))

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


def _draw(logits: torch.Tensor, vocab: int, sampling: Optional[ChainSampling], uniforms, i: int):
    """Token i of a chain from logits [1, V']: argmax (greedy, q None) or a sample with its q [1, V]."""
    logits = fit_vocab(logits, vocab)  # a draft with a smaller vocabulary gives the target's other ids q = 0
    if sampling is None:
        return logits.argmax(-1), None
    return sampling.draw(logits, uniforms[i:i + 1])


def _stack(tokens: list, probs: list) -> tuple:
    return torch.cat(tokens), (None if probs[0] is None else torch.cat(probs))  # [k], [k, V] or None


def graph_pool(runner):
    """The runner's memory pool for captured graphs (made on first use)."""
    if runner._graph_pool is None:
        runner._graph_pool = torch.cuda.graph_pool_handle()
    return runner._graph_pool


def model_chain_steps(runner, logits: torch.Tensor, row: torch.Tensor, k: int, kv: int, vocab: int,
                 sampling: Optional[ChainSampling], u: torch.Tensor):
    """k tokens of a model's chain: token 0 drawn from logits [1, V], token i after one step on token i-1 at
    cache row row + i - 1 (row: [1] on the device). Returns (tokens [k], q [k, V] or None)."""
    token, q = _draw(logits, vocab, sampling, u, 0)
    tokens, probs = [token], [q]
    for i in range(1, k):
        _, logits = _one_step(runner, F.embedding(token, runner.embed_weight), row + i - 1, kv)
        token, q = _draw(logits, vocab, sampling, u, i)
        tokens.append(token)
        probs.append(q)
    return _stack(tokens, probs)


def draft_model_chain(runner, first_logits: torch.Tensor, k: int, vocab: int,
                      sampling: Optional[ChainSampling] = None, uniforms: Optional[torch.Tensor] = None):
    """A chain of k tokens from a draft model whose last forward gave first_logits [1, V] (cache length L):
    token 0 is drawn from them, tokens 1..k-1 each after one more step. Appends k-1 rows; returns (tokens [k],
    q [k, V] or None when greedy), or None when no graph could be made (the caller drafts eagerly).
    uniforms: [k] on the device, for a sampled chain."""
    start_row = runner.length
    kv = runner._kv_width(start_row + k)
    device = runner.device

    def build() -> CapturedChain:
        logits_in = torch.zeros_like(first_logits)  # [1, V]
        start = torch.full((1,), start_row, dtype=torch.long, device=device)
        u_in = torch.zeros(k, dtype=torch.float32, device=device)  # [k]

        def chain(logits, start, u):
            return model_chain_steps(runner, logits, start, k, kv, vocab, sampling, u)

        return CapturedChain(chain, (logits_in, start, u_in), device, graph_pool(runner))

    key = ("draft", k, kv, vocab, first_logits.shape[-1], None if sampling is None else sampling.key)
    graph = ChainGraphs.of(runner).get(key, build)
    if graph is None:
        return None
    drafted = graph.run(first_logits, start_row, uniforms)
    runner._length = start_row + k - 1
    return drafted


def draft_model_round(runner, feed: torch.Tensor, k: int, vocab: int,
                      sampling: Optional[ChainSampling] = None, uniforms: Optional[torch.Tensor] = None):
    """A draft model's whole proposal as one graph: the forward over feed [n] (the tokens committed since its
    last round, at the cache's end L) and the k-token chain drawn from its last row (draft_model_chain's
    chain, one row further on). Appends n + k - 1 rows; returns (tokens [k], q [k, V] or None) or None where
    no graph applies (the caller then runs the forward and the chain apart)."""
    start_row = runner.length
    graph = _draft_round_graph(runner, feed.numel(), k, vocab, sampling)
    if graph is None:
        return None
    drafted = graph.run(feed, start_row, uniforms)
    runner._length = start_row + feed.numel() + k - 1
    return drafted


def prepare_draft_rounds(runner, k: int, vocab: int, sampling: Optional[ChainSampling] = None) -> int:
    """Capture the round graphs of every feed length a round at K can have (1..k+1) now, before the first
    round: captured when first met, a length seen only late in a timed run (all k accepted) stalled it (the
    shipped pair on an H200: K = 8 went from 1.26x to 0.92x over plain decoding). Returns how many exist."""
    return capture_feed_lengths(runner, k, 2 * k + 1,
                                lambda n: _draft_round_graph(runner, n, k, vocab, sampling))


def capture_feed_lengths(runner, k: int, rows: int, graph_of: Callable[[int], object]) -> int:
    """graph_of(n) for every feed length n = 1..k+1 a round at K can have; how many exist. None are made when
    the captures' warm-ups, which write `rows` rows past the cache's end, would not fit."""
    if runner.length + rows > runner.max_length:
        return 0
    return sum(graph_of(n) is not None for n in range(1, k + 2))


def _draft_round_graph(runner, n: int, k: int, vocab: int, sampling: Optional[ChainSampling]):
    """The captured round for a feed of n tokens at K, built on first use; None off the decode path. One
    graph per (n, k): the step reads its start on the device, so every cache length shares it."""
    if not runner._decode_path(n) or n > k + 1:
        return None
    device, start_row = runner.device, runner.length

    def build() -> CapturedChain:
        feed_in = torch.zeros(n, dtype=torch.long, device=device)  # [n]
        start = torch.full((1,), start_row, dtype=torch.long, device=device)
        u_in = torch.zeros(k, dtype=torch.float32, device=device)  # [k]
        depth, block_visible = runner._chain_block(n)

        def round_(tokens, start, u):
            tokens = fill_unknown(tokens, runner.vocab_size, runner.input_fill)
            _, logits = runner._block_step(F.embedding(tokens, runner.embed_weight), start, depth,
                                           block_visible, 0)  # [n, V]
            return model_chain_steps(runner, logits[-1:], start + n, k, 0, vocab, sampling, u)

        return CapturedChain(round_, (feed_in, start, u_in), device, graph_pool(runner))

    key = ("draft-round", n, k, vocab, None if sampling is None else sampling.key)
    return ChainGraphs.of(runner).get(key, build)


def eagle_chain_steps(head, feature: torch.Tensor, start: torch.Tensor, k: int, kv: int, vocab: int,
                      sampling: Optional[ChainSampling], u: torch.Tensor,
                      logits: Optional[torch.Tensor] = None):
    """k tokens of an EAGLE chain from the predicted feature [1, H] after the root: token i is drawn from the
    target's head on feature i; feature i+1 comes from one head step on (feature i, token i) at cache row
    start + i (start: [1] on the device). logits: feature 0's [1, V] where the head's step gave them already
    (its runner shares the target's final norm and LM head); None computes them. Returns (tokens [k], q [k, V]
    or None)."""
    if logits is None:
        logits = head.logits(feature)  # [1, V]
    token, q = _draw(logits, vocab, sampling, u, 0)
    tokens, probs = [token], [q]
    for i in range(1, k):
        feature, logits = _one_step(head.runner, head.fuse(feature, token), start + i - 1, kv)
        token, q = _draw(logits, vocab, sampling, u, i)
        tokens.append(token)
        probs.append(q)
    return _stack(tokens, probs)


def eagle_chain(head, feature: torch.Tensor, logits: torch.Tensor, k: int, vocab: int,
                sampling: Optional[ChainSampling] = None, uniforms: Optional[torch.Tensor] = None):
    """An EAGLE chain of k tokens from the predicted feature [1, H] after the root and its logits [1, V]
    (eagle_chain_steps) as one graph. The head's runner shares the target's final norm and LM head, so its
    step's logits are the next token's logits (no second LM-head product). Appends k-1 rows to the head's
    cache; returns (tokens [k], q [k, V] or None) or None."""
    runner = head.runner
    start_row = runner.length
    kv = runner._kv_width(start_row + k)
    device = runner.device

    def build() -> CapturedChain:
        feature_in, logits_in = torch.zeros_like(feature), torch.zeros_like(logits)  # [1, H], [1, V]
        start = torch.full((1,), start_row, dtype=torch.long, device=device)
        u_in = torch.zeros(k, dtype=torch.float32, device=device)  # [k]

        def chain(feature, logits, start, u):
            return eagle_chain_steps(head, feature, start, k, kv, vocab, sampling, u, logits)

        return CapturedChain(chain, (feature_in, logits_in, start, u_in), device, graph_pool(runner))

    key = ("eagle", k, kv, vocab, None if sampling is None else sampling.key)
    graph = ChainGraphs.of(runner).get(key, build)
    if graph is None:
        return None
    drafted = graph.run(feature, logits, start_row, uniforms)
    runner._length = start_row + k - 1
    return drafted


def eagle_round_body(head, features: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor, k: int, kv: int,
                     vocab: int, sampling: Optional[ChainSampling], u: torch.Tensor):
    """EAGLE's whole proposal: the head's step over the n positions committed since its last round (the
    target's features there [n, F], as the verification gave them, and each one's next token [n]), at cache
    rows start..start+n-1, then the k-token chain from the last predicted feature. kv: the attention width
    (0 on the decode path, which reads start on the device). Returns (tokens [k], q [k, V] or None)."""
    predicted, logits = head_step(head, features, tokens, start, kv, with_logits=True)  # [n, H], [n, V]
    return eagle_chain_steps(head, predicted[-1:], start + tokens.shape[0], k, kv, vocab, sampling, u,
                             logits[-1:])


def head_step(head, features: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor,
              kv: int, with_logits: bool = False):
    """The EAGLE head's step over n committed positions (the target's features [n, F], next tokens [n]) at
    cache rows start..start+n-1, inside a round's graph; returns the predicted features [n, H] (with_logits:
    and the next tokens' logits [n, V] from them, which the step computes anyway)."""
    depth, block_visible = head.runner._chain_block(tokens.shape[0])
    x = head.fuse(head.true_features(features), tokens)  # [n, H]
    predicted, logits = head.runner._block_step(x, start, depth, block_visible, kv)
    return (predicted, logits) if with_logits else predicted


def eagle_round(head, features: torch.Tensor, tokens: torch.Tensor, k: int, vocab: int,
                sampling: Optional[ChainSampling] = None, uniforms: Optional[torch.Tensor] = None):
    """eagle_round_body as one graph per (n, K) on the decode path, like the draft model's round: appends
    n + k - 1 rows to the head's cache and returns (tokens [k], q [k, V] or None), or None where no graph
    applies (the caller then steps the head and drafts the chain apart). features [n, F], tokens [n] on the
    device."""
    runner = head.runner
    start_row = runner.length
    graph = _eagle_round_graph(head, tokens.numel(), k, features.shape[-1], vocab, sampling)
    if graph is None:
        return None
    drafted = graph.run(features, tokens, start_row, uniforms)
    runner._length = start_row + tokens.numel() + k - 1
    return drafted


def prepare_eagle_rounds(head, k: int, width: int, vocab: int,
                         sampling: Optional[ChainSampling] = None) -> int:
    """Capture EAGLE's round graphs of every feed length a round at K can have (1..k+1) before the first
    round (see prepare_draft_rounds). width: the features' F. Returns how many exist."""
    return capture_feed_lengths(head.runner, k, 2 * k + 1,
                                lambda n: _eagle_round_graph(head, n, k, width, vocab, sampling))


def _eagle_round_graph(head, n: int, k: int, width: int, vocab: int, sampling: Optional[ChainSampling]):
    """The captured EAGLE round for n committed positions at K, built on first use; None off the decode
    path."""
    runner = head.runner
    if not runner._decode_path(n) or n > k + 1:
        return None
    device, start_row = runner.device, runner.length

    def build() -> CapturedChain:
        features_in = torch.zeros(n, width, dtype=runner.dtype, device=device)  # [n, F]
        tokens_in = torch.zeros(n, dtype=torch.long, device=device)  # [n]
        start = torch.full((1,), start_row, dtype=torch.long, device=device)
        u_in = torch.zeros(k, dtype=torch.float32, device=device)  # [k]

        def round_(features, tokens, start, u):
            return eagle_round_body(head, features, tokens, start, k, 0, vocab, sampling, u)

        return CapturedChain(round_, (features_in, tokens_in, start, u_in), device, graph_pool(runner))

    key = ("eagle-round", n, k, width, vocab, None if sampling is None else sampling.key)
    return ChainGraphs.of(runner).get(key, build)


def medusa_draft(target, heads, hidden: torch.Tensor, tree, vocab: int):
    """Medusa's whole proposal from the verified feature hidden [H] (the heads, their top ranks, the tree's
    tokens; for a dynamic tree, MedusaCandidates, the candidates' tokens and scores) as one graph replay;
    returns medusa_proposal's row 0 (tokens [N], or tokens [T] and scores [T]), or None where graphs do not
    apply (the caller runs it eagerly)."""
    if not ChainGraphs.available(target, 2):
        return None

    def build() -> CapturedChain:
        def propose(feature):
            return first_row(medusa_proposal(target, heads, feature[None], tree, vocab))

        return CapturedChain(propose, (torch.zeros_like(hidden),), target.device, graph_pool(target))

    graph = ChainGraphs.of(target).get(("medusa", id(heads), tree, vocab), build)
    return None if graph is None else graph.run(hidden)


def first_row(proposal):
    """Row 0 of medusa_proposal's output (a tensor, or a tuple of them)."""
    if isinstance(proposal, tuple):
        return tuple(t[0] for t in proposal)
    return proposal[0]


def medusa_proposal(target, heads, features: torch.Tensor, tree, vocab: int, accepted=None, path=None,
                    chained: bool = False, scores_out: Optional[torch.Tensor] = None):
    """A fixed tree's tokens [M, N] (medusa_rows), or for a dynamic tree (tree.per_round) its candidates'
    tokens and scores, ([M, T], [M, T]) (medusa_candidate_rows, scores_out too), drafted from each row of
    features [M, H]."""
    if tree.per_round:
        return medusa_candidate_rows(target, heads, features, tree, vocab, accepted, path, chained,
                                     scores_out)
    return medusa_rows(target, heads, features, tree, vocab, accepted, path, chained)


# Medusa's heads in sp_medusa_heads (the row's pick, the final norm, the heads' product, SiLU and the residual
# in one launch), the LM head in sp_gemv, on the target's decode kernels; SPECPLAY_MEDUSA_KERNEL=0 keeps the
# torch operations (medusa_heads_reference, the LM head's F.linear), for comparisons
MEDUSA_KERNEL = os.environ.get("SPECPLAY_MEDUSA_KERNEL", "1") != "0"


def medusa_rows(target, heads, features: torch.Tensor, tree, vocab: int,
                accepted: Optional[torch.Tensor] = None, path: Optional[torch.Tensor] = None,
                chained: bool = False) -> torch.Tensor:
    """features [M, H] (pre-norm) -> tokens [M, N]: row i the tree's tokens drafted from row i's feature.
    accepted, path (device [1] and [N], a verification's): the one row that gave its next token instead
    (0 when nothing was accepted, else path[accepted - 1] + 1) -> [1, N], picked on the device. chained: the
    stream's last kernel is a kernel (not a copy), so the heads' may start early behind it."""
    width = tree.width
    logits, rows, kernels = _medusa_logits(target, heads, features, tree.depth, accepted, path, chained)
    if kernels is not None and len(logits) == 1 and width <= TOPK_MAX:
        # the ranking and the tree's pick behind the one product
        index = _medusa_index(tree, rows, logits[0].device)
        return kernels.topk_take(logits[0][:, :vocab], width, index, chained=True)  # [M, N]
    ranked = topk(torch.cat(logits)[:, :vocab], width).indices  # [depth * M, width]
    return ranked.take(_medusa_index(tree, rows, ranked.device))  # [M, N]


def medusa_candidate_rows(target, heads, features: torch.Tensor, candidates, vocab: int,
                          accepted: Optional[torch.Tensor] = None, path: Optional[torch.Tensor] = None,
                          chained: bool = False, scores_out: Optional[torch.Tensor] = None) -> tuple:
    """features [M, H] (pre-norm) -> the candidate paths' tokens [M, T] and scores [M, T] from each row (as
    medusa_rows' rows; accepted, path, chained too): a path's score is the sum of its heads' log-probabilities
    of its ranks, so a path never scores above its prefix (engine.methods.medusa.drafter.MedusaCandidates).
    scores_out: an [M, T] float32 buffer the scores are written into (a round graph's), else a new one."""
    depth, width = candidates.depth, candidates.width
    parts, rows, kernels = _medusa_logits(target, heads, features, depth, accepted, path, chained)
    logits = parts[0] if len(parts) == 1 else torch.cat(parts)  # [depth * M, V']
    # ranked on the log-probabilities (the logits' order): one softmax launch and one top-k, where the values
    # less a logsumexp would be several small launches more in every round
    log_probs = torch.log_softmax(logits[:, :vocab].float(), -1)  # [depth * M, V]
    tables = candidates.tables(log_probs.device)  # last_step [T], steps [T, depth * width]
    if kernels is not None and width <= TOPK_MAX:  # the candidates' tokens taken by the ranking's launch
        (log_p, _), tokens = kernels.topk_and_take(log_probs, width, _medusa_index(candidates, rows,
                                                                                   log_probs.device))
    else:
        log_p, ranked = topk(log_probs, width)  # [depth * M, width]
        # head-major [depth, M, width] -> [M, depth * width]: d * width + r is a candidate's step (flat_index)
        ranked = ranked.view(depth, rows, width).transpose(0, 1).reshape(rows, depth * width)
        tokens = ranked.index_select(1, tables.last_step)  # [M, T]
    log_p = log_p.view(depth, rows, width).transpose(0, 1).reshape(rows, depth * width)
    return tokens, torch.matmul(log_p, tables.steps.T, out=scores_out)  # [M, T], [M, T]


def _medusa_logits(target, heads, features: torch.Tensor, depth: int, accepted, path, chained: bool) -> tuple:
    """The first `depth` heads' logits from each row of features [M, H] (or from the one row accepted and path
    pick, see medusa_rows): ([parts of [depth * M, V'] head-major, float32 from the kernels], M, the decode
    kernels or None). V' may pad the vocabulary."""
    kernels = _medusa_kernels(target, features)
    weight, bias = heads.stacked(depth)  # [depth * H, H], [depth * H]
    eps = target.spec.rms_norm_eps
    if kernels is None:
        outs = medusa_heads_reference(features, target.norm_weight, eps, weight, bias, depth,
                                      None if accepted is None else accepted.clamp_min(0), path)
        outs = heads.second_layer(outs)  # [depth, M, H]
        rows = outs.shape[1]
        return [target.project(outs.reshape(depth * rows, -1))], rows, None
    outs = kernels.medusa_heads(features, target.norm_weight, eps, weight, bias, depth, accepted, path,
                                chained=chained)
    outs = heads.second_layer(outs)  # [depth, M, H]; the second blocks in torch's operations
    behind_ours = heads.second is None  # the LM head's product may start early behind sp_medusa_heads
    rows = outs.shape[1]
    flat = outs.view(depth * rows, -1)  # [depth * M, H], head-major
    parts = [kernels.gemv(flat[i:i + GEMV_MAX_ROWS], target.lm_head, out_f32=True, chained=behind_ours)
             for i in range(0, flat.shape[0], GEMV_MAX_ROWS)]
    return parts, rows, kernels


def medusa_rows_end_in_kernel(target, features: torch.Tensor, tree, rows: int) -> bool:
    """Whether medusa_proposal's last launch for `rows` rows is a kernel of ours (sp_topk picking a fixed
    tree's tokens), so that the next one may start early behind it."""
    return (not tree.per_round and _medusa_kernels(target, features) is not None
            and tree.depth * rows <= GEMV_MAX_ROWS and tree.width <= TOPK_MAX)


def _medusa_kernels(target, features: torch.Tensor):
    """The target's decode kernels where Medusa's heads run in them (see MEDUSA_KERNEL), else None."""
    kernels = getattr(target, "decode_kernels", None)
    hidden = features.shape[-1]
    if not (MEDUSA_KERNEL and kernels is not None and features.is_cuda and features.dtype in HALF_DTYPES
            and hidden % 8 == 0 and hidden <= MEDUSA_MAX_H and gemv_fits(target.lm_head, GEMV_MAX_ROWS)):
        return None
    return kernels


_MEDUSA_INDEX: dict = {}


def _medusa_index(tree, rows: int, device) -> torch.Tensor:
    """[M, N]: where row m's node j sits among the ranks [depth * M, width] (head-major), for the tree's
    flat_index (d * width + r per node); made once per tree, row count and device."""
    key = (tree, rows, str(device))
    index = _MEDUSA_INDEX.get(key)
    if index is None:
        width = tree.width
        places = [[(f // width) * rows * width + m * width + f % width for f in tree.flat_index]
                  for m in range(rows)]
        index = _MEDUSA_INDEX[key] = torch.tensor(places, dtype=torch.long).to(device)
    return index


def medusa_draft_rows(target, heads, features: torch.Tensor, tree, vocab: int):
    """Medusa's proposal from every row of a verified block at once: features [M, H] (pre-norm) ->
    medusa_proposal's [M, ...], row i drafted from row i's feature. Queued behind the verification, before
    the accepted row is known; one graph replay per M where graphs apply, else eager."""
    rows = features.shape[0]

    def propose(block):
        return medusa_proposal(target, heads, block, tree, vocab)

    if not ChainGraphs.available(target, 2):
        return propose(features)

    def build() -> CapturedChain:
        return CapturedChain(propose, (torch.zeros_like(features),), target.device, graph_pool(target))

    graph = ChainGraphs.of(target).get(("medusa_rows", id(heads), tree, vocab, rows), build)
    return propose(features) if graph is None else graph.run(features)
