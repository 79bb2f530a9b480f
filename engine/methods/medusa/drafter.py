"""Medusa: extra heads on the target's last hidden state propose the tokens after the next one.

Head d (d = 1..D) reads x = the target's final-normed feature at position t and predicts token t+1+d through
the target's own LM head: logits_d = lm_head(h_d), h_d = x + SiLU(W_d x + b_d), and with a second block
(Medusa's stacked residual blocks) h_d + SiLU(V_d h_d + c_d) instead. No extra target forward is needed: the
feature comes from the previous verification. The candidates form a sparse tree of top-k choices per head,
verified in one target forward with a tree mask (one-hot q, so lossless under recursive rejection sampling).
The tree is chosen each round: of the paths most often right on validation text (saved with the heads), the
ones its heads are most confident of at this position (a path's summed log-probability), so that a round
drafts deep where the heads are sure and wide where they are not."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F

from engine.errors import SpecplayError
from engine.kernels.step import medusa_heads_reference
from engine.methods.base import DecodeState, Draft, Drafter, DrafterNeeds, DraftStart, RoundCommit
from engine.methods.eagle.drafter import choose_nodes
from engine.methods.medusa.graphs import first_row, medusa_draft, medusa_draft_rows, medusa_proposal

HEADS_FILE = "medusa_heads.safetensors"
CONFIG_FILE = "medusa_config.json"
# The heads draft from every row of a block behind its verification (MedusaDrafter.verified), so the next
# round only picks the accepted row's drafts. Each round keeps the tree's nodes best for its own heads'
# confidence among CANDIDATES fixed paths (the most often right on validation text): MedusaCandidates; the
# method medusa-fixed drafts the fixed tree of the paths most often right (MedusaTree).
CANDIDATES = 32
# For heads saved without measured path accuracies: the assumed chance that the rank-r candidate of head d is
# right is RANK_WEIGHTS[r] * DEPTH_DECAY ** d (ranks 0..3), independently of the other heads.
RANK_WEIGHTS = (0.55, 0.15, 0.08, 0.05)
DEPTH_DECAY = 0.8


class MedusaHeads:
    def __init__(self, weights: list, biases: list, path_accuracy: tuple | None = None,
                 second: tuple | None = None):
        self.weights = weights  # D x [H, H]
        self.biases = biases  # D x [H]
        # the second residual block of each head, if any: (D x [H, H], D x [H])
        self.second = second
        self._stacks: dict = {}  # depth -> the first depth heads' weights [depth * H, H] and biases, stacked
        # depth -> the first depth heads' second blocks, stacked: [depth, H, H] (transposed), [depth, 1, H]
        self._second_stacks: dict = {}
        # ((r_1, ..., r_d), chance): measured chance that every step of the path is right (None: not measured)
        self.path_accuracy = path_accuracy
        # published heads (engine.methods.medusa.public): each head's own LM head, stacked [D, V, H] (None:
        # the target's), and the published default tree's paths (the fixed tree without a size)
        self.lm_heads = None
        self.published_tree = None

    @classmethod
    def load(cls, model_dir, device, dtype) -> "MedusaHeads":
        from safetensors.torch import load_file

        model_dir = Path(model_dir)
        cfg_path, heads_path = check_heads(model_dir)
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
            tensors = load_file(str(heads_path), device=str(device))
            count = int(config["num_heads"])
            layers = int(config.get("layers", 1))
            if layers not in (1, 2):
                raise ValueError(f"{layers} layers a head (1 or 2 are known)")
            weights = [dequantized_weight(tensors, f"heads.{i}", dtype) for i in range(count)]
            biases = [tensors[f"heads.{i}.bias"].to(dtype) for i in range(count)]
            second = None
            if layers == 2:
                second = ([dequantized_weight(tensors, f"second.{i}", dtype) for i in range(count)],
                          [tensors[f"second.{i}.bias"].to(dtype) for i in range(count)])
            path_accuracy = _read_path_accuracy(config.get("path_accuracy"), count)
        except FileNotFoundError:
            raise SpecplayError(f"{model_dir} has no Medusa heads ({HEADS_FILE} + {CONFIG_FILE})") from None
        except (KeyError, ValueError, TypeError, OSError, RuntimeError) as exc:
            raise SpecplayError(f"{model_dir}: cannot read Medusa heads ({exc})") from None
        return cls(weights, biases, path_accuracy, second)

    @property
    def count(self) -> int:
        return len(self.weights)

    @property
    def layers(self) -> int:
        return 1 if self.second is None else 2

    def path_chances(self, depth: int) -> tuple:
        """((r_1, ..., r_d), chance) for paths of at most `depth` heads: measured when the config has them."""
        if self.path_accuracy is None:
            return assumed_chances(depth)
        return tuple(item for item in self.path_accuracy if len(item[0]) <= depth)

    def stacked(self, depth: int) -> tuple:
        """The first `depth` heads' weights [depth * H, H] and biases [depth * H], stacked once."""
        if depth not in self._stacks:
            self._stacks[depth] = (torch.cat(self.weights[:depth]), torch.cat(self.biases[:depth]))
        return self._stacks[depth]

    def second_layer(self, outs: torch.Tensor) -> torch.Tensor:
        """outs [depth, M, H], the first blocks' outputs of the first depth heads -> the heads' outputs: outs
        itself for one-block heads, else outs + SiLU(V_d outs[d] + c_d) for every head d (torch operations
        on every device)."""
        if self.second is None:
            return outs
        depth = outs.shape[0]
        if depth not in self._second_stacks:
            weights, biases = self.second
            self._second_stacks[depth] = (torch.stack(weights[:depth]).transpose(1, 2).contiguous(),
                                          torch.stack(biases[:depth])[:, None, :])
        weight_t, bias = self._second_stacks[depth]  # [depth, H, H] (V_d transposed), [depth, 1, H]
        return outs + F.silu(torch.baddbmm(bias, outs, weight_t))

    def logits(self, runner, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [H] (pre-norm target feature) -> [D, V] logits, one row per head, as the torch twin of
        Medusa's drafting computes them (engine.kernels.step.medusa_heads_reference, the second blocks, then
        the LM head)."""
        weight, bias = self.stacked(self.count)
        eps = runner.spec.rms_norm_eps
        outs = medusa_heads_reference(hidden[None], runner.norm_weight, eps, weight, bias, self.count)
        return self.project(runner, self.second_layer(outs))[:, 0]  # outs [D, 1, H] -> [D, 1, V]

    def project(self, runner, outs: torch.Tensor) -> torch.Tensor:
        """The heads' outputs [depth, M, H] -> logits [depth, M, V] float32: through each head's own LM head
        where it has one (published Medusa), else the target's."""
        if self.lm_heads is None:
            return runner.project(outs)
        depth = outs.shape[0]
        return torch.bmm(outs.to(self.lm_heads.dtype), self.lm_heads[:depth].transpose(1, 2)).float()


def check_heads(model_dir: Path) -> tuple:
    """(config path, heads path) once the config's values and every tensor's dtype and shape (against the
    target's hidden size) are checked from the file's header, before any tensor is read."""
    from engine.models import validate
    from engine.models.llama import read_config_json

    cfg_path, heads_path = validate.head_files(model_dir, HEADS_FILE, CONFIG_FILE, "Medusa heads")
    config = validate.read_head_config(cfg_path, "Medusa heads")
    target = read_config_json(model_dir)
    hidden = target.get("hidden_size") or target.get("n_embd") or target.get("d_model")
    shapes = validate.medusa_head_shapes(config, hidden, cfg_path)
    header = validate.read_safetensors_header(heads_path)
    quantized = [name for name in shapes if name.endswith(".weight")]
    validate.check_head_tensors(header, shapes, heads_path, "Medusa heads", quantized=quantized)
    return cfg_path, heads_path


def dequantized_weight(tensors: dict, name: str, dtype) -> torch.Tensor:
    """`name`.weight [H, H] in dtype: stored as it is, or as int8 with one scale a row (`name`.weight_scale
    [H]), dequantised here (the kernels read the dequantised copy; training's load_medusa reads it too)."""
    weight = tensors[f"{name}.weight"]
    scale = tensors.get(f"{name}.weight_scale")
    if scale is None:
        return weight.to(dtype)
    if weight.dtype != torch.int8 or scale.shape != weight.shape[:1]:
        raise ValueError(f"{name}: an int8 weight {tuple(weight.shape)} needs one scale a row "
                         f"(got {weight.dtype}, scale {tuple(scale.shape)})")
    return (weight.float() * scale.float()[:, None]).to(dtype)


@functools.lru_cache(maxsize=None)
def assumed_chances(depth: int) -> tuple:
    """Every path of up to `depth` heads with its chance under RANK_WEIGHTS and DEPTH_DECAY."""
    chances = []

    def grow(prefix: tuple, chance: float) -> None:
        for rank, weight in enumerate(RANK_WEIGHTS):
            path, right = prefix + (rank,), chance * weight * DEPTH_DECAY ** len(prefix)
            chances.append((path, right))
            if len(path) < depth:
                grow(path, right)

    grow((), 1.0)
    return tuple(chances)


def _read_path_accuracy(values, heads: int) -> tuple | None:
    if values is None:
        return None
    table = tuple((tuple(int(r) for r in path), float(chance)) for path, chance in values)
    known = {path: chance for path, chance in table}
    for path, chance in table:
        if not 0 < len(path) <= heads or min(path) < 0 or not 0.0 <= chance <= 1.0:
            raise ValueError(f"bad path_accuracy entry {list(path)}: {chance}")
        if len(path) > 1 and known.get(path[:-1], -1.0) < chance:
            raise ValueError(f"path_accuracy has {list(path)} without its parent, "
                             f"or more often right than it")
    return table


@functools.lru_cache(maxsize=None)
def default_choices(nodes: int, chances: tuple) -> tuple:
    """The `nodes` paths (r_1, ..., r_d) most likely to be right all the way, best first.

    Siblings carry different tokens, so at most one of them can be right, and the expected number of accepted
    drafts is the sum of the chances over the tree: the top `nodes` maximise it. A path is never more likely
    than its parent and ties go to the shorter path, so the set is closed under prefixes. Cached: building it
    once a round took ~0.4 ms (docs/measurements/profile_rounds_gpu.txt)."""
    ranked = sorted(chances, key=lambda item: (-item[1], len(item[0]), item[0]))
    chosen = tuple(path for path, _ in ranked[:nodes])
    assert all(len(c) == 1 or c[:-1] in chosen for c in chosen)
    return chosen


@dataclass(frozen=True)
class MedusaTree:
    """The tree of a choice set, which does not depend on the tokens: node i is choice i (a parent comes
    before its children), and its token is rank r_d of head d. Siblings differ in rank, and one head's top
    ranks are distinct tokens, so no two siblings ever share a token: merging paths into a trie would change
    nothing."""

    parents: tuple  # [N] parent node, -1 = the last committed token
    # [N] d * width + r: where node i's token sits in the heads' flattened top-`width` ranks
    flat_index: tuple
    depth: int
    width: int
    per_round: ClassVar[bool] = False  # the same tree every round

    @property
    def size(self) -> int:
        return len(self.parents)


@functools.lru_cache(maxsize=None)
def medusa_tree(nodes: int, chances: tuple) -> MedusaTree:
    """The tree of the `nodes` best paths for these path chances (see default_choices)."""
    choices = default_choices(nodes, chances)
    depth = max(len(choice) for choice in choices)
    index = {choice: i for i, choice in enumerate(choices)}
    width = 1 + max(max(choice) for choice in choices)
    parents = tuple(index[choice[:-1]] if len(choice) > 1 else -1 for choice in choices)
    flat_index = tuple((len(choice) - 1) * width + choice[-1] for choice in choices)
    return MedusaTree(parents, flat_index, depth, width)


class CandidateTables(NamedTuple):
    """MedusaCandidates' constants on one device (made once, outside any graph capture)."""

    parents: torch.Tensor  # [T] int64, -1 = the last committed token
    node_depth: torch.Tensor  # [T] int64, a path's length - 1
    ancestors: torch.Tensor  # [T, T] bool, ancestor-or-self
    last_step: torch.Tensor  # [T] int64, d * width + r of the path's last step
    steps: torch.Tensor  # [T, depth * width] float32, 1 at each step of the path


@dataclass(frozen=True)
class MedusaCandidates:
    """The paths a round's tree is chosen from, in level order (a parent before its children): every round
    scores them by its heads' log-probabilities and keeps the best `nodes` (engine.methods.eagle.drafter's
    choose_nodes, sp_tree_choose on CUDA), a tree closed under prefixes whatever the scores."""

    parents: tuple  # [T] parent candidate, -1 = the last committed token
    flat_index: tuple  # [T] d * width + r of each path's last step
    depth: int
    width: int
    nodes: int  # the tree's size, at most T
    paths: tuple  # [T] (r_1, ..., r_d)
    per_round: ClassVar[bool] = True

    @property
    def size(self) -> int:
        return self.nodes

    def tables(self, device) -> CandidateTables:
        key = (self, str(device))
        if key not in _CANDIDATE_TABLES:
            count, index = len(self.paths), {path: i for i, path in enumerate(self.paths)}
            ancestors = torch.zeros(count, count, dtype=torch.bool)
            steps = torch.zeros(count, self.depth * self.width)
            for i, path in enumerate(self.paths):
                for d in range(len(path)):
                    ancestors[i, index[path[:d + 1]]] = True
                    steps[i, d * self.width + path[d]] = 1.0
            depths = torch.tensor([len(path) - 1 for path in self.paths])
            _CANDIDATE_TABLES[key] = CandidateTables(
                torch.tensor(self.parents).to(device), depths.to(device), ancestors.to(device),
                torch.tensor(self.flat_index).to(device), steps.to(device))
        return _CANDIDATE_TABLES[key]

    def choose(self, tokens: torch.Tensor, scores: torch.Tensor) -> tuple:
        """One round's tree from its candidates' tokens [T] and scores [T]: (tokens [N], parents [N], the
        verification block's depth [N+1] and visibility [N+1, N+1]), on their device."""
        tables = self.tables(tokens.device)
        return choose_nodes(tokens.contiguous(), tables.parents, scores.float().contiguous(),
                            tables.node_depth, tables.ancestors, self.nodes)


_CANDIDATE_TABLES: dict = {}


@functools.lru_cache(maxsize=None)
def medusa_candidates(nodes: int, chances: tuple) -> MedusaCandidates:
    """The max(CANDIDATES, nodes) paths most often right (default_choices) in level order, for trees of
    `nodes` (fewer where fewer paths are known)."""
    best = default_choices(max(CANDIDATES, nodes), chances)
    paths = tuple(sorted(best, key=lambda path: (len(path), best.index(path))))
    index = {path: i for i, path in enumerate(paths)}
    width = 1 + max(max(path) for path in paths)
    return MedusaCandidates(
        parents=tuple(index[path[:-1]] if len(path) > 1 else -1 for path in paths),
        flat_index=tuple((len(path) - 1) * width + path[-1] for path in paths),
        depth=max(len(path) for path in paths), width=width, nodes=min(nodes, len(paths)), paths=paths)


class MedusaDrafter(Drafter):
    name = "medusa"
    # the prompt's features give the first round a draft too: the last prefilled position's feature is the one
    # before the prompt's last token, which that round feeds first (the role of the last committed token)
    needs = DrafterNeeds(prefill_features=True, block_features=True)

    def __init__(self, target, heads: MedusaHeads, nodes: int | None = None, dynamic: bool = True):
        """dynamic: the tree chosen every round (MedusaCandidates), or False for the fixed tree of the paths
        most often right (the method medusa-fixed)."""
        self.target = target
        self.heads = heads
        self.nodes = nodes
        self.dynamic = dynamic
        # (nodes, heads) -> (MedusaCandidates, None), or with a fixed tree (MedusaTree, its host parents)
        self._trees: dict = {}
        self.last_feature = None  # [H] the verified feature that gave the last committed token
        # What was drafted from every row of the last verified block (see verified): medusa_proposal's
        # [N+1, ...] (a fixed tree's tokens, or the candidates' tokens and scores); and the row whose draft
        # the next round takes once the outcome is known
        self.early = None
        self.early_row = None
        self.early_is_row = False  # early is [1, ...], the accepted row's already (a round graph's replay)

    def start(self, state: DecodeState, start: DraftStart) -> None:
        self.early = self.early_row = None
        features = start.prefill_features  # [P-1, H], None for a one-token prompt
        self.last_feature = None if features is None or len(features) == 0 else features[-1]

    def verified(self, state: DecodeState, features: torch.Tensor) -> None:
        """Draft from every row of the block behind its verification: the heads run on the GPU while the host
        reads the outcome, and the next round only picks the accepted row's tree (medusa_draft_rows)."""
        tree, _ = self._tree(*self._shape(state.config.k))
        self.early_is_row = False
        self.early = medusa_draft_rows(self.target, self.heads, features, tree, state.vocab_size)

    def commit(self, state: DecodeState, commit: RoundCommit) -> None:
        self.last_feature = commit.last_feature
        if self.early is None:
            self.early_row = None
        else:
            self.early_row = 0 if self.early_is_row else commit.accepted_rows[-1]

    def propose(self, state: DecodeState, k: int) -> Draft:
        hidden = self.last_feature
        if hidden is None:  # a one-token prompt's first round: no feature yet
            return Draft(tokens=torch.zeros(0, dtype=torch.long, device=state.device))
        tree, parents = self._tree(*self._shape(k))
        if self.early is not None and self.early_row is not None:
            row = self.early_row
            proposal = tuple(t[row] for t in self.early) if tree.per_round else self.early[row]
            self.early = self.early_row = None
        else:
            proposal = medusa_draft(self.target, self.heads, hidden, tree, state.vocab_size)
            if proposal is None:  # no graphs here: the same proposal, eagerly
                proposal = first_row(medusa_proposal(self.target, self.heads, hidden[None], tree,
                                                     state.vocab_size))
        if tree.per_round:
            return self._chosen(tree, *proposal)
        return Draft(tokens=proposal, parents=parents)  # tokens [N]

    def _chosen(self, candidates: MedusaCandidates, tokens: torch.Tensor, scores: torch.Tensor) -> Draft:
        """The round's tree from its candidates' tokens [T] and scores [T]: on the device for a target that
        takes device trees (its parents copied back with the round's readout), else with host parents."""
        tokens, parents, block_depth, block_visible = candidates.choose(tokens, scores)
        if getattr(self.target, "takes_device_trees", False) and parents.device.type != "cpu":
            return Draft(tokens=tokens, parents=parents, tree_block=(block_depth, block_visible))
        return Draft(tokens=tokens, parents=parents.cpu())

    replays_rounds = True  # its round after an unread one is a replay of its round graph (round_graph)

    def round_graph(self, state: DecodeState, config, width: int):
        """Rounds as one self-feeding graph replay each (engine.core.graphs), where it applies."""
        if self.early is None:
            return None
        from engine.methods.medusa.graphs import medusa_round_graph

        tree, _ = self._tree(*self._shape(config.k))
        s = config.sampling
        warp = None if s.greedy else (s.temperature, s.top_k, s.top_p)
        return medusa_round_graph(self.target, self.heads, tree, state.backend, state.vocab_size, width, warp)

    def replayed(self, graph) -> None:
        # the drafts from the replayed block's accepted row, for a round launched apart
        self.early, self.early_is_row = graph.proposal, True

    def _shape(self, k: int) -> tuple:
        """(nodes, heads) of the tree for K = k: a fixed tree of published heads without a size is their
        published tree (its paths of at most K heads)."""
        depth = min(k, self.heads.count)
        published = self.heads.published_tree
        if not self.nodes and not self.dynamic and published is not None:
            return sum(len(path) <= depth for path in published), depth
        return self.nodes or 2 * k, depth

    def _tree(self, nodes: int, heads: int) -> tuple:
        """(the tree's candidates, None), or with a fixed tree (the tree, its parents [N] on the host), for
        these shapes."""
        key = (nodes, heads)
        if key not in self._trees:
            chances = self.heads.path_chances(heads)
            if self.dynamic:
                self._trees[key] = (medusa_candidates(nodes, chances), None)
            else:
                tree = medusa_tree(nodes, chances)
                self._trees[key] = (tree, torch.tensor(tree.parents, dtype=torch.long))
        return self._trees[key]


class FixedTreeMedusaDrafter(MedusaDrafter):
    """Medusa with its original fixed tree, the same every round (method medusa-fixed): beside `medusa` it
    shows what choosing the tree per position buys and costs."""

    name = "medusa-fixed"

    def __init__(self, target, heads: MedusaHeads, nodes: int | None = None):
        super().__init__(target, heads, nodes, dynamic=False)
