"""EAGLE-3: the EAGLE drafter over fused low, middle and high target features (trained with training-time
test).

What differs from EAGLE (engine/methods/eagle/drafter.py), whose drafting it reuses (chain of K, dynamic tree
of N):
- the head reads the outputs of several target layers (`tap_layers` in eagle3_config.json, e.g. a low, a
  middle and the last one): the decoder asks the target runner for them (DrafterNeeds.tap_layers) and the head
  projects them side by side to the hidden size (`proj`, [H, taps * H]) before the usual fusion with the next
  token's embedding (`fc`, [H, 2H]) and its decoder layer;
- from the second drafted token on it reads its own outputs, which training taught it to do (training-time
  test: the head ran on its own predictions for several steps, with a loss at each), and it predicts tokens
  (the target's distribution, self-distilled), not the target's features.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from engine.errors import SpecplayError
from engine.methods.base import DrafterNeeds
from engine.methods.eagle.drafter import EagleDrafter, EagleHead, load_head_layer

HEAD_FILE = "eagle3_head.safetensors"
CONFIG_FILE = "eagle3_config.json"
PUBLISHED_DIR = "eagle3"  # a published-layout head in the target's folder (registry.EAGLE3_PUBLISHED_FILES)


def own_published_head(model_dir) -> Optional[Path]:
    """The target folder's published-layout EAGLE-3 head (its eagle3/ folder) where the project's own files
    are absent, else None: the project's own head (HEAD_FILE, CONFIG_FILE) wins where both are present."""
    if model_dir is None:
        return None
    folder = Path(str(model_dir))
    published = folder / PUBLISHED_DIR
    if (folder / HEAD_FILE).exists() or not (published / "config.json").exists():
        return None
    return published


class Eagle3Head(EagleHead):
    def __init__(self, fc: torch.Tensor, proj: torch.Tensor, tap_layers: tuple, layer_runner, target):
        super().__init__(fc, layer_runner, target)
        self.proj = proj  # [H, taps * H]
        self.tap_layers = tuple(int(i) for i in tap_layers)

    @classmethod
    def load(cls, model_dir, target) -> "Eagle3Head":
        tensors, config, runner = load_head_layer(model_dir, target, HEAD_FILE, CONFIG_FILE, "EAGLE-3 head",
                                                  fused_taps=True)
        taps = tuple(config.get("tap_layers") or ())
        proj = tensors.get("proj.weight")
        hidden = target.hidden_size
        layers = getattr(getattr(target, "spec", None), "num_layers", None)
        if not taps or proj is None or tuple(proj.shape) != (hidden, len(taps) * hidden):
            raise SpecplayError(f"{model_dir}: the EAGLE-3 head needs tap_layers in {CONFIG_FILE} and a "
                                f"proj.weight of [{hidden}, taps x {hidden}]")
        if layers is not None and not all(0 <= i < layers for i in taps):
            raise SpecplayError(f"{model_dir}: EAGLE-3 tap layers {list(taps)} outside the target's {layers}")
        return cls(tensors["fc.weight"], proj, taps, runner, target)

    def true_features(self, features: torch.Tensor) -> torch.Tensor:
        """The tap layers' outputs [n, taps * H] -> the head's feature [n, H]."""
        features = features.to(self.proj.dtype)
        kernels = self.gemv_kernels(self.proj, features)
        if kernels is not None:
            return kernels.gemv(features, self.proj)
        return F.linear(features, self.proj)


class Eagle3Drafter(EagleDrafter):
    name = "eagle3"

    def __init__(self, target, head: Eagle3Head, tree_nodes: int = 0):
        if not hasattr(target, "tap_layers"):
            raise SpecplayError("EAGLE-3 reads the target's inner layers: it needs the compact Llama-family "
                                "runner (engine.models.llama; not --tp)")
        super().__init__(target, head, tree_nodes)
        self.needs = DrafterNeeds(prefill_features=True, block_features=True, tap_layers=head.tap_layers)
