"""EAGLE-1/2 heads in the published SafeAILab layout (model.safetensors or pytorch_model.bin + config.json).

The head reads fc([embed(x_{t+1}) ; f_t]) (embedding first) with f_t the target's last hidden state after
its final norm; its one decoder layer has no input norm (layer 0 of the published model); its output goes to
the target's LM head as it is (no norm) and is the next draft step's feature. Drafting (chain or tree) is
EAGLE's (engine.methods.eagle.drafter)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.errors import SpecplayError
from engine.methods import public_heads as ph
from engine.methods.eagle.drafter import EagleHead

WHAT = "EAGLE head"


def expected_shapes(info: ph.HeadsInfo, target) -> tuple:
    """(name -> shape of every tensor the head reads, LayerShape, intermediate, inv_freq)."""
    cfg_path = info.folder / "config.json"
    hidden = target.hidden_size
    if info.config.get("hidden_size", hidden) != hidden:
        raise SpecplayError(f"{cfg_path}: hidden_size {info.config.get('hidden_size')} does not fit the "
                            f"target's {hidden}")
    vocab = info.config.get("vocab_size")
    if vocab is not None and vocab != target.vocab_size:
        raise SpecplayError(f"{cfg_path}: vocab_size {vocab} does not fit the target's {target.vocab_size}")
    shape, inter, inv_freq = ph.layer_config(info.config, cfg_path, hidden)
    shapes = {"fc.weight": (hidden, 2 * hidden), **ph.layer_shapes("layers.0.", shape, hidden, inter)}
    if info.config.get("bias", True):
        shapes["fc.bias"] = (hidden,)
    return shapes, shape, inter, inv_freq


class PublicEagleHead(EagleHead):
    """EagleHead's interface (true_features, fuse, logits, runner) over the published forward."""

    def __init__(self, fc: torch.Tensor, fc_bias, embed: torch.Tensor, runner: ph.HeadLayer, target):
        super().__init__(fc, runner, target)
        self.fc_bias = fc_bias  # [H] or None
        self.embed_weight = embed  # [V, H]

    @classmethod
    def load(cls, info: ph.HeadsInfo, target) -> "PublicEagleHead":
        shapes, shape, _, inv_freq = expected_shapes(info, target)
        header = ph.read_header(info.weights)
        ph.check_shapes(header, shapes, info.weights, WHAT)
        own_embed = "embed_tokens.weight" in header
        if own_embed:
            ph.check_shapes(header, {"embed_tokens.weight": (target.vocab_size, target.hidden_size)},
                            info.weights, WHAT)
        names = list(shapes) + (["embed_tokens.weight"] if own_embed else [])
        return cls.from_tensors(ph.load_tensors(info.weights, names, target.device, target.dtype), shape,
                                inv_freq, target)

    @classmethod
    def from_tensors(cls, t: dict, shape: ph.LayerShape, inv_freq, target) -> "PublicEagleHead":
        """The head over its tensors (expected_shapes' names, on the target's device), checked or made."""
        runner = ph.HeadLayer(ph.layer_weights(t, "layers.0."), shape, inv_freq,
                              prepare=lambda x: (x, x),  # layer 0: no input norm
                              readout=target.project, max_length=target.max_length,
                              step_kernels=getattr(target, "decode_kernels", None))
        embed = t.get("embed_tokens.weight", target.embed_weight)
        return cls(t["fc.weight"], t.get("fc.bias"), embed, runner, target)

    def true_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's raw last-layer features [n, H] -> after its final norm (what the head was trained
        on)."""
        return self.target.final_norm(features)

    def fuse(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """[n, H] features, [n] next tokens -> fc([embedding ; feature]) [n, H]."""
        embeds = F.embedding(next_tokens.to(self.embed_weight.device), self.embed_weight)
        return F.linear(torch.cat([embeds, features.to(self.fc.dtype)], dim=-1), self.fc, self.fc_bias)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.target.project(features)  # [n, V] float32: the LM head alone
