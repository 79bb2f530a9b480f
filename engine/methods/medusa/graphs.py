"""Medusa's captured graphs: the heads' proposal from the verified feature (medusa_draft, medusa_rows,
medusa_candidate_rows on sp_medusa_heads, sp_gemv and sp_topk where the target has the decode kernels) and
the replayed round with its tree verification (MedusaRoundGraph)."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from engine.core.graphs import (
    CapturedChain,
    ChainGraphs,
    RoundGraph,
    attention_width,
    chained,
    ends_in_kernel,
    graph_pool,
    keep_path,
    keeps_path_in_kernel,
    round_kernels,
)
from engine.kernels.step import (
    GEMV_MAX_ROWS,
    HALF_DTYPES,
    MEDUSA_MAX_H,
    TOPK_MAX,
    chain_block_reference,
    chain_commit_reference,
    gemv_fits,
    medusa_heads_reference,
    topk,
)

_MEDUSA_INDEX: dict = {}


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


# Medusa's heads run in sp_medusa_heads (the row's pick, the final norm, the heads' product, SiLU and the
# residual in one launch), the LM head in sp_gemv, on the target's decode kernels; elsewhere in their torch
# twins (medusa_heads_reference, the LM head's F.linear)


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
    kernels = None if heads.lm_heads is not None else _medusa_kernels(target, features)
    weight, bias = heads.stacked(depth)  # [depth * H, H], [depth * H]
    eps = target.spec.rms_norm_eps
    if kernels is None:
        outs = medusa_heads_reference(features, target.norm_weight, eps, weight, bias, depth,
                                      None if accepted is None else accepted.clamp_min(0), path)
        outs = heads.second_layer(outs)  # [depth, M, H]
        rows = outs.shape[1]
        return [heads.project(target, outs).reshape(depth * rows, -1)], rows, None
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
    """The target's decode kernels where Medusa's heads run in them, else None."""
    kernels = getattr(target, "decode_kernels", None)
    hidden = features.shape[-1]
    if not (kernels is not None and features.is_cuda and features.dtype in HALF_DTYPES
            and hidden % 8 == 0 and hidden <= MEDUSA_MAX_H and gemv_fits(target.lm_head, GEMV_MAX_ROWS)):
        return None
    return kernels


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


# Medusa's replayed round drafts the next tree from its block's accepted row only, picked on the device (one
# row through the heads and the LM head)


class MedusaRoundGraph(RoundGraph):
    """One Medusa round (greedy or sampled) at a fixed tree (MedusaTree), or at a tree chosen every round
    from fixed candidates (MedusaCandidates): such a round first chooses its tree from the candidates' tokens
    and scores that the last round drafted, and the tree's parents are an output of the graph, copied back
    with the readout."""

    def __init__(self, target, heads, tree, backend, vocab: int, width: int, warp: Optional[tuple] = None):
        """warp: (temperature, top_k, top_p) for sampled rounds (recursive rejection sampling with the
        uniforms copied into `verify_u` before each replay), None for greedy ones."""
        device, n, per_round = target.device, tree.size, tree.per_round
        self.target, self.depth, self.nodes = target, tree.depth, n
        self.per_round = per_round
        # the last round's outcome and drafts, and its block's start: the replay's inputs
        self.accepted = torch.zeros(1, dtype=torch.long, device=device)
        self.path = torch.full((n,), -1, dtype=torch.long, device=device)
        self.next_token = torch.zeros(1, dtype=torch.long, device=device)
        # the next round's drafts (a fixed tree's N tokens, or the T candidates' tokens and scores), from the
        # last block's accepted row only
        shape = (1, len(tree.paths) if per_round else n)
        self.early = torch.zeros(shape, dtype=torch.long, device=device)
        self.early_scores = torch.zeros(shape, dtype=torch.float32, device=device) if per_round else None
        # a start past the cache's end for the warm-up and the capture: they write only free rows
        self.start = torch.full((1,), target.length, dtype=torch.long, device=device)
        self.verify_u = torch.zeros(1, n + 1, dtype=torch.float32, device=device)  # [1, N+1], sampled rounds
        if not per_round:
            self.parents = torch.tensor(tree.parents, dtype=torch.long)  # [N] host, for the events
            fixed_tree = (self.parents.to(device),  # [N]
                          *target.tree_block(torch.cat((torch.tensor([-1]), self.parents + 1))))
        kv = attention_width(target, n + 1)
        minus_one = torch.full((1,), -1, dtype=torch.long, device=device)
        rows = target.row_indices(self.depth)  # [D]
        # the block from the last outcome, and the new outcome into the next replay's inputs, as a chain's
        kernels = round_kernels(target, backend)
        block = chain_block_reference if kernels is None else kernels.chain_block
        commit = chain_commit_reference if kernels is None else kernels.chain_commit

        if kernels is not None and keeps_path_in_kernel(target, self.path[:self.depth]):
            # the block's kernel starts early behind the kept path's (both kernels, no copy between)
            block = functools.partial(kernels.chain_block, chained=True)
        pdl = chained(ends_in_kernel(target, kernels, n + 1) and warp is None)  # greedy: verify, readout

        def round_():
            if per_round:  # the tree first: the block's kernel follows the kept path's
                drafts, tree_parents, block_depth, block_visible = tree.choose(*self._drafted_row())
                self.parents = tree_parents  # [N] on the device, the event's (copied back with the readout)
            else:
                (drafts,), (tree_parents, block_depth, block_visible) = self._drafted_row(), fixed_tree
            keep_path(target, self.start, self.path[:self.depth], rows)
            # tokens [N+1] = [next token, drafts], start [1] = the last start + 1 + accepted, x [N+1, H]
            tokens, start, x = block(self.next_token, drafts, self.start, self.accepted, target.embed_weight)
            hidden, logits = target.block_step(x, start, block_depth, block_visible, kv,
                                                after_step_kernel=kernels is not None)  # [N+1, H], [N+1, V]
            if warp is None:
                result = backend.verify_tree_greedy(logits[None], tokens[None, 1:], tree_parents, **pdl)
            else:  # one-hot q: Medusa's tokens are its heads' top ranks
                result = backend.verify_tree_stochastic(logits[None], tokens[None, 1:], tree_parents, None,
                                                        self.verify_u, *warp)
            temperature = 1.0 if warp is None else warp[0]
            values = backend.readout(logits, result, tokens[1:], temperature, width, **pdl)
            # (the readout's is a kernel: the heads' may start behind it)
            # a chosen tree's candidates' scores straight into the next round's input
            scores_out = self.early_scores if per_round else None
            # the heads on the row that gave the next token, picked on the device
            early = medusa_proposal(target, heads, hidden, tree, vocab, result.accepted[:1],
                                    result.path[0], chained=True, scores_out=scores_out)  # [1, ...]
            early_tokens = early[0] if per_round else early
            # accepted (>= 0: -1 flags NaN, which the readout raises), next token, drafts, start and path
            behind_topk = kernels is not None and medusa_rows_end_in_kernel(target, hidden, tree,
                                                                            len(early_tokens))
            commit(result.accepted, result.next_token, early_tokens.view(-1), start, self.accepted,
                   self.next_token, self.early.view(-1), self.start, path_in=result.path[0], path=self.path,
                   **chained(behind_topk))
            return tokens, hidden, logits, result, values

        self._minus_one = minus_one
        self._capture(target, round_)

    @property
    def proposal(self):
        """The drafts of the last replay's block (the Medusa drafter's early): the tokens, or the candidates'
        tokens and scores."""
        return (self.early, self.early_scores) if self.per_round else self.early

    def _drafted_row(self) -> tuple:
        """(drafts [N],) or (candidate tokens [T], scores [T]): what the last block's accepted row drafted."""
        buffers = (self.early, self.early_scores) if self.per_round else (self.early,)
        return tuple(b[0] for b in buffers)

    def _accepted_row(self) -> torch.Tensor:
        """[1] the last block's row whose distribution gave its next token: its accepted path's last node's
        row, 0 when nothing was accepted (read from the outcome buffers, on the device)."""
        path = torch.cat((self._minus_one, self.path))  # [N+1]
        return path.index_select(0, self.accepted) + 1

    def seed(self, launched, drafter) -> None:
        """Take a round launched without the graph as the next replay's last round: its outcome (device),
        the drafts from its rows (the Medusa drafter's early [rows, ...]) and its block's start."""
        self._seed_outcome(launched)
        self.accepted.clamp_(min=0)
        if launched.result.path.shape[-1] == self.nodes:
            self.path.copy_(launched.result.path[0])
        else:  # an empty draft: nothing to keep
            self.path.fill_(-1)
        drafted = drafter.early if self.per_round else (drafter.early,)
        buffers = (self.early, self.early_scores) if self.per_round else (self.early,)
        for buffer, rows in zip(buffers, drafted):
            buffer.copy_(rows.index_select(0, self._accepted_row()))


def medusa_round_graph(target, heads, tree, backend, vocab: int, width: int,
                       warp: Optional[tuple] = None) -> Optional[MedusaRoundGraph]:
    """The captured round for this tree, built on first use and kept with the target's graphs; None where it
    does not apply: no graphs, no decode path for the block, no compiled kernels, or too little free cache
    for the capture's rows."""
    n = tree.size + 1
    if not (ChainGraphs.available(target, 2) and backend.compiles_kernels and target.decode_path(n)):
        return None
    if target.length + 1 + tree.depth + n > target.max_length:
        return None
    key = ("medusa_round", id(heads), tree, vocab, width, warp)
    return ChainGraphs.of(target).get(
        key, lambda: MedusaRoundGraph(target, heads, tree, backend, vocab, width, warp))
