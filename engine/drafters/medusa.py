"""Medusa: extra heads on the target's last hidden state propose the tokens after the next one.

Head d (d = 1..D) reads x = the target's final-normed feature at position t and predicts token t+1+d through
the target's own LM head: logits_d = lm_head(x + SiLU(W_d x + b_d)). No extra target forward is needed: the
feature comes from the previous verification. The candidates form a sparse tree of top-k choices per head,
verified in one target forward with a tree mask (one-hot q, so lossless under recursive rejection sampling)."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.drafters.base import DecodeState, Draft, Drafter
from engine.errors import SpecplayError
from engine.runner import to_device

HEADS_FILE = "medusa_heads.safetensors"
CONFIG_FILE = "medusa_config.json"
# Assumed chance that the rank-r candidate of a head is right, used only to order tree choices.
RANK_WEIGHTS = (0.55, 0.15, 0.08, 0.05, 0.03, 0.02)
DEPTH_DECAY = 0.8


class MedusaHeads:
    def __init__(self, weights: list, biases: list):
        self.weights = weights  # D x [H, H]
        self.biases = biases  # D x [H]

    @classmethod
    def load(cls, model_dir, device, dtype) -> "MedusaHeads":
        from safetensors.torch import load_file

        model_dir = Path(model_dir)
        try:
            config = json.loads((model_dir / CONFIG_FILE).read_text())
            tensors = load_file(str(model_dir / HEADS_FILE), device=str(device))
            count = int(config["num_heads"])
            weights = [tensors[f"heads.{i}.weight"].to(dtype) for i in range(count)]
            biases = [tensors[f"heads.{i}.bias"].to(dtype) for i in range(count)]
        except FileNotFoundError:
            raise SpecplayError(f"{model_dir} has no Medusa heads ({HEADS_FILE} + {CONFIG_FILE})") from None
        except (KeyError, ValueError, OSError, RuntimeError) as exc:
            raise SpecplayError(f"{model_dir}: cannot read Medusa heads ({exc})") from None
        return cls(weights, biases)

    @property
    def count(self) -> int:
        return len(self.weights)

    def logits(self, runner, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [H] (pre-norm target feature) -> [D, V] logits, one row per head."""
        x = runner.final_norm(hidden[None])  # [1, H]
        outs = [x + F.silu(F.linear(x, w, b)) for w, b in zip(self.weights, self.biases)]  # D x [1, H]
        return runner.project(torch.cat(outs))  # [D, V]


@functools.lru_cache(maxsize=None)
def default_choices(nodes: int, depth: int, width: int = 4) -> tuple:
    """The `nodes` most promising rank tuples (r_1, ..., r_d), closed under prefixes, best first.
    Cached: building it took ~0.4 ms, once a round, before (docs/measurements/profile_rounds_gpu.txt)."""
    scored = []

    def grow(prefix, score):
        if len(prefix) == depth:
            return
        for rank in range(min(width, len(RANK_WEIGHTS))):
            choice = prefix + (rank,)
            s = score * RANK_WEIGHTS[rank] * (DEPTH_DECAY ** len(prefix))
            scored.append((s, choice))
            grow(choice, s)

    grow((), 1.0)
    scored.sort(key=lambda item: (-item[0], item[1]))
    chosen = tuple(c for _, c in scored[:nodes])
    assert all(c[:-1] in chosen or len(c) == 1 for c in chosen)  # a child scores below its parent
    return chosen


@dataclass(frozen=True)
class MedusaTree:
    """The tree of a choice set, which does not depend on the tokens: node i is choice i (a parent comes before
    its children), and its token is rank r_d of head d. Siblings differ in rank, and one head's top ranks are
    distinct tokens, so no two siblings ever share a token: merging paths into a trie would change nothing."""

    parents: tuple  # [N] parent node, -1 = the last committed token
    flat_index: tuple  # [N] d * width + r: where node i's token sits in the heads' flattened top-`width` ranks
    depth: int
    width: int


@functools.lru_cache(maxsize=None)
def medusa_tree(nodes: int, depth: int) -> MedusaTree:
    choices = default_choices(nodes, depth)
    index = {choice: i for i, choice in enumerate(choices)}
    width = 1 + max(max(choice) for choice in choices)
    parents = tuple(index[choice[:-1]] if len(choice) > 1 else -1 for choice in choices)
    flat_index = tuple((len(choice) - 1) * width + choice[-1] for choice in choices)
    return MedusaTree(parents, flat_index, depth, width)


class MedusaDrafter(Drafter):
    name = "medusa"

    def __init__(self, target, heads: MedusaHeads, nodes: int | None = None):
        self.target = target
        self.heads = heads
        self.nodes = nodes
        self._on_device: dict = {}  # (nodes, depth, device) -> (flat_index on the device, parents on the host)

    def propose(self, state: DecodeState, k: int) -> Draft:
        hidden = state.extras.get("last_hidden")
        if hidden is None:  # first round: no verified feature yet
            return Draft(tokens=torch.zeros(0, dtype=torch.long, device=state.device))
        tree = medusa_tree(self.nodes or 2 * k, min(k, self.heads.count))
        flat_index, parents = self._tree_tensors(tree, state.device)
        head_logits = self.heads.logits(self.target, hidden)[:tree.depth, :state.vocab_size]  # [depth, V]
        ranked = torch.topk(head_logits, tree.width, dim=-1).indices  # [depth, width], stays on the device
        return Draft(tokens=ranked.flatten()[flat_index], parents=parents)  # tokens [N]

    def _tree_tensors(self, tree: MedusaTree, device) -> tuple:
        key = (tree, str(device))
        if key not in self._on_device:
            self._on_device[key] = (to_device(list(tree.flat_index), device),
                                    torch.tensor(tree.parents, dtype=torch.long))
        return self._on_device[key]
