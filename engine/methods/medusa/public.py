"""Medusa heads in the published layouts: FasterDecoding's Medusa-1 (medusa_lm_head.safetensors or .pt +
config.json with medusa_num_heads, medusa_num_layers; keys {h}.{l}.linear.weight|bias and {h}.{L}.weight)
and vLLM's (model_type medusa; blocks.{h}.layers.{l}.weight|bias and lm_heads.{h}.weight).

Head h reads x = the target's final-normed hidden state, applies its residual blocks x + SiLU(W x + b) and its
own LM head. They run on Medusa's drafter (engine.methods.medusa.drafter) with their own LM heads; the fixed
tree without a size is the published default tree of 63 nodes (mc_sim_7b_63)."""
from __future__ import annotations

import torch

from engine.errors import SpecplayError
from engine.methods import public_heads as ph
from engine.methods.medusa.drafter import MedusaHeads
from engine.models import validate

WHAT = "Medusa heads"
# FasterDecoding/Medusa's default tree for 7B models (medusa_choices.mc_sim_7b_63): each path is the ranks
# taken from heads 1..d, listed best first
MC_SIM_7B_63 = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,),
    (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0),
    (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0),
    (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1),
    (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
)


def published_order(paths: tuple, heads: int) -> tuple:
    """The published tree as path chances for Medusa's tree choice: only its order is known, so the i-th path
    gets 1 - i / (len + 1) (a child always after its parent, so never above it); paths past the heads are
    left out."""
    kept = [path for path in paths if len(path) <= heads]
    return tuple((path, 1.0 - i / (len(kept) + 1)) for i, path in enumerate(kept))


def names(info: ph.HeadsInfo) -> tuple:
    """(heads, blocks a head, a function (head, block) -> weight name prefix, head -> LM head name)."""
    cfg = info.config
    cfg_path = info.folder / "config.json"
    if info.layout.startswith("Medusa-1"):
        count, layers = cfg.get("medusa_num_heads"), cfg.get("medusa_num_layers", 1)
        block, lm_head = (lambda h, b: f"{h}.{b}.linear."), (lambda h: f"{h}.{layers}.weight")
        fields = ("medusa_num_heads", "medusa_num_layers")
    else:
        count, layers = cfg.get("num_heads"), cfg.get("num_hidden_layers", 1)
        block, lm_head = (lambda h, b: f"blocks.{h}.layers.{b}."), (lambda h: f"lm_heads.{h}.weight")
        fields = ("num_heads", "num_hidden_layers")
    most = validate.MAX_MEDUSA_HEADS
    if not (isinstance(count, int) and not isinstance(count, bool) and 1 <= count <= most):
        raise SpecplayError(f"{cfg_path}: {fields[0]} must be an integer in 1..{validate.MAX_MEDUSA_HEADS} "
                            f"(got {str(count)[:40]})")
    if layers not in range(1, ph.MAX_HEAD_LAYERS + 1) or isinstance(layers, bool):
        raise SpecplayError(f"{cfg_path}: {fields[1]} must be 1 or 2 (got {str(layers)[:40]})")
    return count, layers, block, lm_head


def expected_shapes(info: ph.HeadsInfo, target) -> dict:
    count, layers, block, lm_head = names(info)
    hidden, vocab = target.hidden_size, target.vocab_size
    for key, want in (("hidden_size", hidden), ("vocab_size", vocab)):
        value = info.config.get(key, want)
        if value != want:
            raise SpecplayError(f"{info.folder / 'config.json'}: {key} {value} does not fit the target's "
                                f"{want}")
    shapes = {}
    for h in range(count):
        for b in range(layers):
            shapes.update({block(h, b) + "weight": (hidden, hidden), block(h, b) + "bias": (hidden,)})
        shapes[lm_head(h)] = (vocab, hidden)
    return shapes


def load(info: ph.HeadsInfo, target) -> MedusaHeads:
    """The published heads as MedusaHeads with their own LM heads, every shape checked first."""
    shapes = expected_shapes(info, target)
    ph.check_shapes(ph.read_header(info.weights), shapes, info.weights, WHAT)
    return from_tensors(info, ph.load_tensors(info.weights, shapes, target.device, target.dtype))


def from_tensors(info: ph.HeadsInfo, t: dict) -> MedusaHeads:
    """The heads over their tensors (expected_shapes' names, on the target's device), checked or made."""
    count, layers, block, lm_head = names(info)
    blocks = [([t[block(h, b) + "weight"] for h in range(count)],  # D x [H, H]
               [t[block(h, b) + "bias"] for h in range(count)]) for b in range(layers)]  # D x [H]
    measured = measured_paths(info, count)
    heads = MedusaHeads(blocks[0][0], blocks[0][1], measured or published_order(MC_SIM_7B_63, count),
                        blocks[1] if layers == 2 else None)
    heads.lm_heads = torch.stack([t[lm_head(h)] for h in range(count)])  # [D, V, H]
    if measured is None:
        heads.published_tree = tuple(path for path in MC_SIM_7B_63 if len(path) <= count)
    return heads


def measured_paths(info: ph.HeadsInfo, count: int):
    """The path accuracies measured for these heads, where they travel in the config
    (`specplay_path_accuracy`, written by main.py export-heads; other engines ignore it): the heads then
    choose their trees as before the export. None where absent."""
    from engine.methods.medusa.drafter import _read_path_accuracy

    values = info.config.get("specplay_path_accuracy")
    if values is None:
        return None
    try:
        return _read_path_accuracy(values, count)
    except (ValueError, TypeError) as exc:
        raise SpecplayError(f"{info.folder / 'config.json'}: specplay_path_accuracy: "
                            f"{validate.one_line(exc)}") from None
