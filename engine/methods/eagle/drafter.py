"""EAGLE: a one-layer head drafts at the feature level from the target's own top-layer features.

Input at position t: fc([f_t ; e(x_{t+1})]) with f_t the target's last-layer feature (before the final norm)
and e the target's embedding of the next token; the head's decoder layer (own KV cache over positions)
predicts f_{t+1}, and the target's final norm + LM head turn it into the distribution of x_{t+2}.
After each verification the head is fed the target's true features for the newly committed positions,
then drafts autoregressively on its own predicted features: a chain of K (sampled from q, speculative
sampling) or a dynamic tree (expand the most likely nodes by cumulative draft probability, keep the best N;
one-hot q, recursive rejection sampling)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from engine.core.graphs import CapturedChain, ChainGraphs, capture_feed_lengths, chain_sampling, graph_pool
from engine.errors import SpecplayError
from engine.kernels.step import (
    TREE_MAX,
    gemv_fits,
    topk,
    tree_choose_reference,
    tree_kernels,
    tree_level_reference,
)
from engine.methods.base import DecodeState, Draft, Drafter, DrafterNeeds, DraftStart, RoundCommit, draw_token
from engine.methods.eagle.graphs import (
    eagle_chain,
    eagle_round,
    head_step,
    prepare_eagle_rounds,
    run_at_cache_end,
)
from engine.models.llama import LlamaRunner, LlamaSpec, read_config_json
from engine.models.runner import to_device

HEAD_FILE = "eagle_head.safetensors"
CONFIG_FILE = "eagle_config.json"
TREE_BRANCH = 3  # children tried per expanded node
TREE_FRONTIER = 4  # nodes expanded per depth
# subtracted per depth from a candidate's score: a child then ranks strictly below its parent, even when its
# own log-probability rounds to 0
TIE_BREAK = 1e-4
# The head's step over the committed positions and its chain are one graph (the fused round); a chain's round
# and a greedy tree's behind an unread one are replays of their captured rounds (engine.methods.eagle.graphs).
# The head's fusion (fc over [feature | the next token's embedding]) is one sp_gemv that gathers the
# embeddings itself, where the head runs the decode kernels (one launch for an embedding, a cat and a cuBLAS
# product).


@dataclass
class PendingFeed:
    """What the head has not read yet: the target's features [m, F] (raw: before true_features), the rows of
    them that were committed (None: the first len(next_tokens), a chain's accepted prefix), and each committed
    position's next token."""

    features: torch.Tensor
    rows: Optional[list]
    next_tokens: list

    @classmethod
    def of_rows(cls, features: torch.Tensor, rows: list, next_tokens: list) -> "PendingFeed":
        """rows left as None when they are the first ones (read as a slice, no gather)."""
        return cls(features, None if rows == list(range(len(rows))) else list(rows), next_tokens)

    @property
    def contiguous(self) -> bool:
        return self.rows is None

    def committed_features(self) -> torch.Tensor:
        """[n, F] on the device."""
        if self.contiguous:
            return self.features[:len(self.next_tokens)]
        return self.features[to_device(self.rows, self.features.device)]


class EagleHead:
    """The fc fusion plus a one-layer Llama runner that shares the target's final norm and LM head."""

    def __init__(self, fc: torch.Tensor, layer_runner: LlamaRunner, target):
        self.fc = fc  # [H, 2H]
        self.runner = layer_runner
        self.target = target

    @classmethod
    def load(cls, model_dir, target) -> "EagleHead":
        tensors, _, runner = load_head_layer(model_dir, target, HEAD_FILE, CONFIG_FILE, "EAGLE head")
        return cls(tensors["fc.weight"], runner, target)

    def true_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [n, H] as the head reads them (EAGLE-3 fuses several layers here)."""
        return features

    def fuse(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """[n, H] features and [n] next tokens -> [n, H] head inputs."""
        kernels = self.gemv_kernels(self.fc, features)
        embed = self.target.embed_weight
        if (kernels is not None and self.fc.shape[1] % 16 == 0 and embed.dtype == self.fc.dtype
                and next_tokens.dtype == torch.long and next_tokens.device == features.device):
            return kernels.gemv(features, self.fc, embed=embed, tokens=next_tokens.contiguous())
        pair = torch.cat([features.to(self.fc.dtype), self.target.embed(next_tokens).to(self.fc.dtype)],
                         dim=-1)
        return F.linear(pair, self.fc)

    def gemv_kernels(self, weight: torch.Tensor, features: torch.Tensor):
        """The head runner's decode kernels where sp_gemv multiplies these features [n, F] by this weight
        else None (batched features [B, m, F] keep torch's product)."""
        kernels = getattr(self.runner, "decode_kernels", None)
        if (kernels is None or features.dim() != 2 or features.dtype != weight.dtype or not features.is_cuda
                or not features.is_contiguous() or features.data_ptr() % 16
                or not gemv_fits(weight, features.shape[0])):
            return None
        return kernels

    def step(self, features, next_tokens, parents=None) -> torch.Tensor:
        """Append n positions to the head's cache; returns predicted next features [n, H]."""
        return self.runner.forward_embeds(self.fuse(features, next_tokens), parents).hidden

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.target.logits_from_hidden(features)  # [n, V] float32


def load_head_layer(model_dir, target, head_file: str, config_file: str, what: str, fused_taps: bool = False):
    """Read a head's tensors and config beside the target and build the one-layer Llama runner of its decoder
    layer (sharing the target's final norm and LM head). The config's values, the file's header (a truncated
    file fails here), every tensor's dtype and shape are checked before anything is allocated
    (engine.models.validate). fused_taps: EAGLE-3's tap_layers and proj. Returns (the other tensors in the
    target's dtype, the head's config, the runner)."""
    from safetensors.torch import load_file

    from engine.models import validate

    model_dir = Path(str(model_dir))
    cfg_path, head_path = validate.head_files(model_dir, head_file, config_file, what)
    head_config = validate.read_head_config(cfg_path, what)
    header = validate.read_safetensors_header(head_path)
    config = dict(read_config_json(model_dir))
    config.update({k: v for k, v in head_config.items() if k in (
        "num_attention_heads", "num_key_value_heads", "intermediate_size", "rope_theta", "rms_norm_eps",
        "head_dim")})
    config.update(num_hidden_layers=1, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    spec = LlamaSpec.from_dict(config)
    validate.check_llama_config(spec, config, cfg_path)
    taps = 0
    if fused_taps:
        layers = getattr(getattr(target, "spec", None), "num_layers", None)
        taps = len(validate.check_tap_layers(head_config, layers, cfg_path))
    validate.check_head_tensors(header, validate.eagle_head_shapes(spec, taps), head_path, what)
    try:
        tensors = load_file(str(head_path), device=str(target.device))
    except (ValueError, OSError, RuntimeError) as exc:
        raise SpecplayError(f"{head_path}: cannot read the {what} ({exc})") from None
    weights = {f"model.layers.0.{k[len('layer.'):]}": tensors.pop(k) for k in list(tensors)
               if k.startswith("layer.")}
    weights.update({"model.embed_tokens.weight": target.embed_weight,
                    "model.norm.weight": target.norm_weight,
                    "lm_head.weight": target.lm_head})
    runner = LlamaRunner(spec, weights, device=target.device, dtype=target.dtype,
                         max_length=target.max_length, path=head_path)
    return {k: v.to(target.dtype) for k, v in tensors.items()}, head_config, runner


class EagleDrafter(Drafter):
    name = "eagle"
    needs = DrafterNeeds(prefill_features=True, block_features=True)

    def __init__(self, target, head: EagleHead, tree_nodes: int = 0):
        self.target = target
        self.head = head
        self.tree_nodes = tree_nodes  # 0: a chain of K
        self.true_length = 0  # head cache rows built from the target's true features
        self.pending = None  # (features [m, H], next tokens [m]) not yet fed to the head

    def start(self, state: DecodeState, start: DraftStart) -> None:
        self.head.runner.reset()
        self.true_length = 0
        features = start.prefill_features  # [P-1, F] for positions 0..P-2
        if features is None:
            self.pending = None
            return
        self.pending = PendingFeed(features, None, state.tokens[1:])
        sampling = chain_sampling(state)
        k = state.config.k
        if self.tree_nodes > 0:
            prepare_tree_rounds(self.head, k, features.shape[-1], state.vocab_size, self.tree_nodes)
        elif self._fuses(sampling):
            prepare_eagle_rounds(self.head, k, features.shape[-1], state.vocab_size, sampling)

    def _fuses(self, sampling) -> bool:
        """Whether a chain round at K (1 included) can run as one graph
        (engine.methods.eagle.graphs.eagle_round)."""
        return (self.tree_nodes == 0
                and ChainGraphs.rounds_available(self.head.runner, sampling))

    def propose(self, state: DecodeState, k: int) -> Draft:
        if self.pending is None:  # a one-token prompt: no feature to start from yet
            return Draft(tokens=torch.zeros(0, dtype=torch.long, device=state.device))
        self.head.runner.rollback(self.true_length)
        pending, self.pending = self.pending, None
        tokens = to_device(pending.next_tokens, state.device)  # [n]
        if self.tree_nodes > 0:
            return self._tree(state, pending.committed_features(), tokens, k)
        sampling = chain_sampling(state)
        uniforms = None if sampling is None else state.uniforms(k)  # [k] on the device
        if pending.contiguous and self._fuses(sampling):  # the head's step and the chain in one graph
            drafted = eagle_round(self.head, pending.committed_features(), tokens, k, state.vocab_size,
                                  sampling, uniforms)
            if drafted is not None:
                self.true_length = self.head.runner.length - (k - 1)
                return Draft(tokens=drafted[0], probs=drafted[1])
        feature, logits = self._step(pending.committed_features(), tokens)
        return self._chain(state, feature, logits, k, sampling, uniforms)

    replays_rounds = True  # a round after an unread one may be a replay of its round graph (round_graph)

    def round_graph(self, state: DecodeState, config, width: int):
        """A chain's rounds as one self-feeding graph replay each (engine.core.graphs.EagleRoundGraph),
        where the fused round applies; greedy trees' too (EagleTreeRoundGraph) where the target takes
        device trees; a one-token prompt's first rounds go apart."""
        if self.tree_nodes:
            return self._tree_round_graph(state, config, width)
        sampling = chain_sampling(state)
        if not self._fuses(sampling) or self.true_length == 0:
            return None
        from engine.methods.eagle.graphs import eagle_round_graph

        return eagle_round_graph(self.target, self.head, config.k, state.backend, state.vocab_size, width,
                                 sampling)

    def _tree_round_graph(self, state: DecodeState, config, width: int):
        if not state.config.sampling.greedy or self.true_length == 0:
            return None
        if not getattr(self.target, "takes_device_trees", False):
            return None
        from engine.methods.eagle.graphs import eagle_tree_round_graph

        return eagle_tree_round_graph(self.target, self.head, config.k, self.tree_nodes, state.backend,
                                      state.vocab_size, width, _grow_tree, _tree_size(config.k))

    def _step(self, features: torch.Tensor, tokens: torch.Tensor) -> tuple:
        """Feed the head the committed positions (raw features [n, F], next tokens [n]); returns the
        predicted feature [1, H] of the position after the root and its logits [1, V] (the head's runner
        shares the target's final norm and LM head), as the fused round (engine.core.graphs) takes
        them."""
        x = self.head.fuse(self.head.true_features(features), tokens)
        out = self.head.runner.forward_embeds(x)
        self.true_length = self.head.runner.length
        return out.hidden[-1:], out.logits[-1:]

    def _chain(self, state: DecodeState, feature: torch.Tensor, logits: torch.Tensor, k: int, sampling,
               uniforms) -> Draft:
        if ChainGraphs.available(self.head.runner, k, sampling):
            drafted = eagle_chain(self.head, feature, logits, k, state.vocab_size, sampling, uniforms)
            if drafted is not None:
                return Draft(tokens=drafted[0], probs=drafted[1])
        tokens, probs = [], []
        for i in range(k):
            # [1], [1, V] or None
            uniform = None if uniforms is None else uniforms[i:i + 1]
            token, q = draw_token(state, logits[:, :state.vocab_size], uniform)
            tokens.append(token)
            probs.append(q)
            # the head's runner shares the target's norm and LM head: its logits are the next ones
            if i < k - 1:
                out = self.head.runner.forward_embeds(self.head.fuse(feature, token))
                feature, logits = out.hidden[-1:], out.logits[-1:]
        return Draft(tokens=torch.cat(tokens), probs=None if probs[0] is None else torch.cat(probs))

    def _tree(self, state: DecodeState, features: torch.Tensor, next_tokens: torch.Tensor,
              depth: int) -> Draft:
        """Dynamic tree after the head's step over the committed positions (features [n, F], next tokens
        [n]): per depth, expand the TREE_FRONTIER best nodes by cumulative log-probability into TREE_BRANCH
        children each; finally keep the tree_nodes best nodes (a child never outscores its parent). Grown and
        chosen on the device level by level (each level's nodes appended to the head's cache, seeing their
        ancestors), the step and the growth one graph where graphs apply: nothing waits for the GPU. A
        target that takes device trees gets the parents and the verification block's depths and mask on the
        device; another one gets the parents on the host (one copy)."""
        grown = tree_round(self.head, features, next_tokens, depth, state.vocab_size, self.tree_nodes)
        if grown is None:  # no graph: the head's step, then the growth (itself a graph where it can be)
            grown = grow_tree(self.head, self._step(features, next_tokens)[0], depth, state.vocab_size,
                              self.true_length, self.tree_nodes)
        else:
            self.true_length = self.head.runner.length
        tokens, parents, block_depth, block_visible = grown
        if getattr(self.target, "takes_device_trees", False) and parents.device.type != "cpu":
            return Draft(tokens=tokens, parents=parents, tree_block=(block_depth, block_visible))
        return Draft(tokens=tokens, parents=parents.cpu())

    def commit(self, state: DecodeState, commit: RoundCommit) -> None:
        if commit.fed_ahead:  # the replayed round after this one fed the head these rows on the device
            self.true_length += len(commit.accepted_rows)
            self.head.runner.set_length(self.true_length)  # the host's view; the chain's rows lie past it
            self.pending = None
            return
        self.head.runner.rollback(self.true_length)
        rows = commit.accepted_rows  # block rows of the root and the accepted path
        start = len(state.tokens) - len(rows)  # state.tokens index of the first token after the root
        next_tokens = state.tokens[start:start + len(rows)]
        if len(next_tokens) < len(rows):  # generation ended mid-path (EOS or length)
            self.pending = None
            return
        # read at the next propose, before the next verification overwrites the block's features
        self.pending = PendingFeed.of_rows(commit.block_features, rows, next_tokens)


def _grow_tree(head, root_feature: torch.Tensor, depth: int, vocab: int, true_length: torch.Tensor, kv: int,
               nodes: int):
    """The draft tree on the device: its `nodes` best candidates (see choose_nodes). The candidates, [T] in
    level order: level d's nodes are written to the head's cache after its true rows (cache row true_length +
    node, position true_length + d) and see the true rows and their own ancestors; the head's length is left
    as it was (later levels and the next round overwrite those rows). true_length: [1] on the device and kv a
    fixed attention width, so that the whole growth is one graph."""
    runner = head.runner
    device = root_feature.device
    total = _tree_size(depth)
    node_depth = _node_depths(depth, device)  # [T], made before the capture (a constant of the graph)
    ancestors = torch.zeros(total, total, dtype=torch.bool, device=device)  # [T, T] ancestor-or-self
    node_rows = true_length + torch.arange(total, device=device)  # [T]: the cache row of each node
    node_of_col = torch.arange(kv, device=device) - true_length  # [kv]: the tree node a cache column holds
    in_tree = (node_of_col >= 0) & (node_of_col < total)
    col_node, true_col = node_of_col.clamp(0, total - 1), node_of_col < 0  # [kv] each
    feats, frontier = root_feature, torch.full((1,), -1, dtype=torch.long, device=device)
    frontier_scores = torch.zeros(1, dtype=torch.float32, device=device)
    # every candidate's token, parent (a candidate id, -1 = the root) and cumulative log-probability [T]
    tokens_all, parents_all = (torch.zeros(total, dtype=torch.long, device=device) for _ in range(2))
    scores_all = torch.zeros(total, dtype=torch.float32, device=device)
    kernels = tree_kernels(device) if total <= TREE_MAX else None  # else the levels' torch twin
    count = 0
    for level in range(depth):
        logp = torch.log_softmax(head.logits(feats)[:, :vocab], dim=-1)  # [F, V]
        top = topk(logp, TREE_BRANCH)  # [F, B]
        width = min(TREE_FRONTIER, top.values.numel())
        level_args = (top.values.float().contiguous(), top.indices.contiguous(), frontier_scores, frontier,
                      width, count, ancestors, node_depth, true_length, tokens_all, parents_all, scores_all)
        local_parent, positions, next_frontier, next_scores = (
            tree_level_reference(*level_args) if kernels is None else kernels.tree_level(*level_args))
        rows = slice(count, count + width)  # the level's node ids
        if level < depth - 1:
            inputs = head.fuse(feats[local_parent], tokens_all[rows])  # [W, H]
            if runner.takes_tree_levels(width, count + width):  # the level after its earlier nodes
                seen = ancestors[:count + width, :count + width]  # [count + W, count + W]
                feats = runner.step_tree_level(inputs, positions, true_length, count, seen)
            else:
                visible = (ancestors[rows][:, col_node] & in_tree) | true_col  # [W, kv]: true rows, ancestors
                mask = torch.full((width, kv), float("-inf"), dtype=runner.dtype, device=device)
                mask.masked_fill_(visible, 0.0)
                feats = runner.step_embeds(inputs, positions, node_rows[rows], mask)
            frontier, frontier_scores = next_frontier, next_scores
        count += width
    nodes = min(nodes, total)
    return choose_nodes(tokens_all, parents_all, scores_all, node_depth, ancestors, nodes)


def choose_nodes(tokens, parents, scores, node_depth, ancestors, nodes: int) -> tuple:
    """The `nodes` best candidates by cumulative log-probability as a draft tree, on their device.

    Candidates [T] in level order (parents index earlier candidates, -1 = the root; ancestors [T, T]
    ancestor-or-self). A node never scores above its parent; TIE_BREAK per depth makes it strictly below, so
    the best `nodes` hold every chosen node's ancestors and the tree has exactly `nodes` nodes (a fixed
    shape: no host decision). Returns tokens [N], parents [N] (in the tree, level order), and the
    verification block's depth [N+1] and visibility [N+1, N+1] (row 0: the last committed token):
    sp_tree_choose where the kernels are loaded, else its twin (engine.kernels.step.tree_choose_reference)."""
    kernels = tree_kernels(tokens.device) if tokens.numel() <= TREE_MAX else None
    if kernels is None:
        return tree_choose_reference(tokens, parents, scores, node_depth, ancestors, nodes, TIE_BREAK)
    return kernels.tree_choose(tokens, parents, scores, node_depth, ancestors, nodes, TIE_BREAK)


def _tree_size(depth: int) -> int:
    return min(TREE_BRANCH, TREE_FRONTIER) + TREE_FRONTIER * (depth - 1)


_NODE_DEPTHS: dict = {}  # (depth, device) -> [T] each candidate's level


def _node_depths(depth: int, device) -> torch.Tensor:
    """[T] int64: the level of each candidate (level 0 holds min(B, F) nodes, each later one F). Made once and
    kept: made inside a capture it would be a kernel in every replay."""
    key = (depth, str(device))
    if key not in _NODE_DEPTHS:
        widths = [min(TREE_BRANCH, TREE_FRONTIER)] + [TREE_FRONTIER] * (depth - 1)
        _NODE_DEPTHS[key] = torch.repeat_interleave(torch.arange(depth), torch.tensor(widths)).to(device)
    return _NODE_DEPTHS[key]


def _tree_kv(runner, true_length: int, depth: int) -> int:
    """The growth's attention width: the whole cache where graphs replay (one graph serves every length),
    else the rows it needs."""
    if ChainGraphs.available(runner, 2):
        return runner.max_length
    return runner.kv_width(true_length + _tree_size(depth))


def grow_tree(head, root_feature: torch.Tensor, depth: int, vocab: int, true_length: int,
              nodes: int) -> tuple:
    """_grow_tree from the predicted feature [1, H] after the root, replayed as one CUDA graph per (depth,
    nodes) where graphs apply."""
    runner = head.runner
    kv = _tree_kv(runner, true_length, depth)
    length = torch.full((1,), true_length, dtype=torch.long, device=root_feature.device)
    if not ChainGraphs.available(runner, 2):
        return _grow_tree(head, root_feature, depth, vocab, length, kv, nodes)

    def build() -> CapturedChain:
        def grow(feature, length):
            return _grow_tree(head, feature, depth, vocab, length, kv, nodes)

        return CapturedChain(grow, (torch.zeros_like(root_feature), length.clone()), runner.device,
                             graph_pool(runner))

    graph = ChainGraphs.of(runner).get(("tree", depth, kv, vocab, nodes), build)
    if graph is None:
        return _grow_tree(head, root_feature, depth, vocab, length, kv, nodes)
    return graph.run(root_feature, true_length)


def tree_round_body(head, features: torch.Tensor, next_tokens: torch.Tensor, start: torch.Tensor, depth: int,
                    vocab: int, nodes: int, kv: int) -> tuple:
    """The tree round's device work: the head's step over the n committed positions (features [n, F], next
    tokens [n]) at cache rows start.. (start [1] on the device; the decode path's attention), then the tree
    grown from its last predicted feature after them (_grow_tree)."""
    predicted = head_step(head, features, next_tokens, start, 0)  # [n, H]
    return _grow_tree(head, predicted[-1:], depth, vocab, start + next_tokens.shape[0], kv, nodes)


def tree_round(head, features: torch.Tensor, next_tokens: torch.Tensor, depth: int, vocab: int,
               nodes: int):
    """tree_round_body as one graph per (n, depth, nodes) on the decode path: appends the n positions to the
    head's cache (its length grows by n) and returns the tree (choose_nodes' four tensors), or None where no
    graph applies. Feed lengths 1..depth+1 are captured when first met, or beforehand by
    prepare_tree_rounds."""
    graph = _tree_round_graph(head, next_tokens.numel(), depth, features.shape[-1], vocab, nodes)
    return run_at_cache_end(head.runner, graph, next_tokens.numel(), features, next_tokens)


def prepare_tree_rounds(head, depth: int, width: int, vocab: int, nodes: int) -> int:
    """Capture the tree round of every feed length (1..depth+1) before the first round (see
    engine.core.graphs.prepare_draft_rounds); width: the features' F. Returns how many exist."""
    return capture_feed_lengths(head.runner, depth, depth + 1 + _tree_size(depth),
                                lambda n: _tree_round_graph(head, n, depth, width, vocab, nodes))


def _tree_round_graph(head, n: int, depth: int, width: int, vocab: int, nodes: int):
    runner = head.runner
    if not ChainGraphs.available(runner, 2) or not runner.decode_path(n) or n > depth + 1:
        return None
    device, start_row, kv = runner.device, runner.length, runner.max_length

    def build() -> CapturedChain:
        features_in = torch.zeros(n, width, dtype=runner.dtype, device=device)  # [n, F]
        tokens_in = torch.zeros(n, dtype=torch.long, device=device)  # [n]
        start = torch.full((1,), start_row, dtype=torch.long, device=device)

        def round_(features, tokens, start):
            return tree_round_body(head, features, tokens, start, depth, vocab, nodes, kv)

        return CapturedChain(round_, (features_in, tokens_in, start), device, graph_pool(runner))

    return ChainGraphs.of(runner).get(("eagle-tree-round", n, depth, width, vocab, nodes), build)
