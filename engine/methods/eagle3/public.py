"""EAGLE-3 heads in the published layouts: SpecForge (LlamaForCausalLMEagle3), vLLM / AngelSlim
(Eagle3LlamaForCausalLM), both with weights under midlayer.*, and speculators (speculators_model_type eagle3,
transformer_layer_config, weights under layers.0.*).

Forward: g = fc([h_a ; h_b ; h_c]) from the target's tapped layers (transformers' hidden_states[k], the
residual stream before layer k), then one layer whose attention reads [input_layernorm(embed(x)) ;
hidden_norm(g)] (width 2H), residual g (hidden_norm(g) with norm_before_residual); its output is the next
step's g, and lm_head(norm(output)) gives logits over the draft vocabulary, target id = draft id + d2t[draft
id]. Ids outside the draft vocabulary get q = 0, so sampling stays lossless."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.errors import SpecplayError
from engine.methods import public_heads as ph
from engine.methods.eagle.drafter import EagleHead

WHAT = "EAGLE-3 head"
UNSUPPORTED_OPTIONS = ("norm_before_fc", "fc_norm", "norm_output")


def layer_source(info: ph.HeadsInfo) -> tuple:
    """(the layer's config, the weights' layer prefix)."""
    if info.layout == "EAGLE-3 (speculators)":
        return dict(info.config["transformer_layer_config"]), "layers.0."
    return dict(info.config), "midlayer."


def tap_layers(info: ph.HeadsInfo, target_layers: int) -> tuple:
    """The tapped layers as written (default (2, L//2, L-3)); each must be a layer 1..L-1 of the target
    (hidden_states[0] is the embedding, hidden_states[L] the final norm's output)."""
    cfg_path = info.folder / "config.json"
    taps = info.taps if info.taps is not None else (2, target_layers // 2, target_layers - 3)
    if not (isinstance(taps, tuple) and len(taps) == 3
            and all(isinstance(t, int) and not isinstance(t, bool) for t in taps)):
        raise SpecplayError(f"{cfg_path}: eagle_aux_hidden_state_layer_ids must list 3 layer indices "
                            f"(got {str(info.taps)[:60]})")
    bad = [t for t in taps if not 1 <= t < target_layers]
    if bad:
        raise SpecplayError(f"{cfg_path}: tapped layer {bad[0]} is outside the target's layers 1.."
                            f"{target_layers - 1} (eagle_aux_hidden_state_layer_ids {list(taps)})")
    return taps


def expected(info: ph.HeadsInfo, target) -> tuple:
    """(name -> shape, LayerShape, inv_freq, taps, draft vocabulary, layer prefix), refusing a head that
    does not fit the target from the config alone."""
    cfg_path = info.folder / "config.json"
    for option in UNSUPPORTED_OPTIONS:
        if info.config.get(option):
            raise SpecplayError(f"{cfg_path}: option {option} is not supported yet")
    layer_cfg, prefix = layer_source(info)
    hidden_t, vocab_t = target.hidden_size, target.vocab_size
    shape, inter, inv_freq = ph.layer_config(layer_cfg, cfg_path, hidden_t)
    hidden = shape.hidden
    target_hidden = info.config.get("target_hidden_size") or hidden
    if target_hidden != hidden_t:
        raise SpecplayError(f"{cfg_path}: target_hidden_size {target_hidden} does not fit the target's "
                            f"hidden size {hidden_t}")
    vocab = layer_cfg.get("vocab_size", vocab_t)
    if vocab != vocab_t:
        raise SpecplayError(f"{cfg_path}: vocab_size {vocab} does not fit the target's {vocab_t}")
    draft_vocab = info.config.get("draft_vocab_size", vocab_t)
    if not (isinstance(draft_vocab, int) and 1 <= draft_vocab <= vocab_t):
        raise SpecplayError(f"{cfg_path}: draft_vocab_size {str(draft_vocab)[:20]} must be in 1..{vocab_t}")
    layers = getattr(getattr(target, "spec", None), "num_layers", None)
    if layers is None:
        raise SpecplayError("EAGLE-3 reads the target's inner layers: it needs the compact Llama-family "
                            "runner")
    taps = tap_layers(info, layers)
    shapes = {"fc.weight": (hidden, 3 * hidden_t), "norm.weight": (hidden,),
              "lm_head.weight": (draft_vocab, hidden),
              f"{prefix}hidden_norm.weight": (hidden,), f"{prefix}input_layernorm.weight": (hidden,),
              **ph.layer_shapes(prefix, shape, 2 * hidden, inter)}
    return shapes, shape, inv_freq, taps, draft_vocab, prefix


def check_d2t(d2t: torch.Tensor, vocab: int, weights) -> None:
    """Every draft id maps into the target's vocabulary, no two onto one id."""
    ids = torch.arange(d2t.numel()) + d2t.cpu().long()
    bad = ((ids < 0) | (ids >= vocab)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise SpecplayError(f"{weights}: d2t[{i}] = {int(d2t[i])} maps draft id {i} to {int(ids[i])}, "
                            f"outside the target's vocabulary of {vocab}")
    if ids.unique().numel() != ids.numel():
        raise SpecplayError(f"{weights}: d2t maps two draft ids onto one target id")


class PublicEagle3Head(EagleHead):
    """EagleHead's interface over the published EAGLE-3 forward (see the module's docstring)."""

    def __init__(self, fc, fc_bias, embed, norms: dict, lm_head, target_ids, taps: tuple, runner, target):
        super().__init__(fc, runner, target)
        self.fc_bias = fc_bias  # [H] or None
        self.embed_weight = embed  # [V, H]
        self.norms = norms  # input, hidden, final: [H] each
        self.lm_head = lm_head  # [Vd, H]
        self.target_ids = target_ids  # [Vd] int64, or None: the draft vocabulary is the target's
        self.before_residual = False  # norm_before_residual: the residual is hidden_norm(g), not g
        self.set_convention(taps, False)

    def set_convention(self, taps: tuple, before_residual: bool) -> None:
        """Read the target at these tapped layers (transformers' hidden_states[k], the residual stream
        before layer k) with this norm option: the config's own, or one the head doctor tries."""
        self.taps_as_written = tuple(taps)
        # the runner's tap layers: hidden_states[k] is the output of layer k - 1; sorted and unique, as the
        # runner returns them side by side in layer order
        self.tap_layers = tuple(sorted({k - 1 for k in taps}))
        self._order = [self.tap_layers.index(k - 1) for k in taps]
        self.before_residual = bool(before_residual)

    def prepare(self, x: torch.Tensor) -> tuple:
        """The layer's input x [n, 2H] = [embedding ; g] -> (attention input [n, 2H], residual [n, H])."""
        embeds, g = x.chunk(2, dim=-1)
        eps = self.runner_eps
        normed = ph.rms_norm(g, self.norms["hidden"], eps)
        attn_in = torch.cat([ph.rms_norm(embeds, self.norms["input"], eps), normed], dim=-1)
        return attn_in, normed if self.before_residual else g

    @classmethod
    def load(cls, info: ph.HeadsInfo, target) -> "PublicEagle3Head":
        shapes, shape, inv_freq, taps, draft_vocab, prefix = expected(info, target)
        header = ph.read_header(info.weights)
        ph.check_shapes(header, shapes, info.weights, WHAT)
        optional = {"fc.bias": (shape.hidden,), "embed_tokens.weight": (target.vocab_size, shape.hidden)}
        present = [name for name in optional if name in header]
        ph.check_shapes(header, {name: optional[name] for name in present}, info.weights, WHAT)
        if "embed_tokens.weight" not in present and shape.hidden != target.hidden_size:
            raise SpecplayError(f"{info.weights}: embed_tokens.weight missing (the head's hidden size "
                                "differs from the target's)")
        mapped = draft_vocab != target.vocab_size or "d2t" in header
        if mapped:
            d2t = header.get("d2t")
            if d2t is None or d2t.shape != (draft_vocab,) or d2t.dtype not in ("I64", "I32"):
                raise SpecplayError(f"{info.weights}: d2t must be an integer tensor [{draft_vocab}] "
                                    f"(got {None if d2t is None else (list(d2t.shape), d2t.dtype)})")
        t = ph.load_tensors(info.weights, list(shapes) + present + (["d2t"] if mapped else []), "cpu",
                            target.dtype)
        target_ids = None
        if mapped:
            check_d2t(t["d2t"], target.vocab_size, info.weights)
            target_ids = (torch.arange(draft_vocab) + t.pop("d2t").long()).to(target.device)
        t = {name: v.to(target.device) for name, v in t.items()}
        return cls.from_tensors(info, t, target_ids, target)

    @classmethod
    def from_tensors(cls, info: ph.HeadsInfo, t: dict, target_ids, target) -> "PublicEagle3Head":
        """The head over its tensors (expected's names, on the target's device) and its draft vocabulary's
        target ids ([Vd] int64, or None), checked or made."""
        _, shape, inv_freq, taps, _, prefix = expected(info, target)
        norms = {"input": t[f"{prefix}input_layernorm.weight"], "hidden": t[f"{prefix}hidden_norm.weight"],
                 "final": t["norm.weight"]}
        head = cls(t["fc.weight"], t.get("fc.bias"), t.get("embed_tokens.weight", target.embed_weight), norms,
                   t["lm_head.weight"], target_ids, taps, None, target)
        head.set_convention(taps, bool(info.config.get("norm_before_residual", False)))
        head.info = info  # what its folder said (the doctor and the window describe it)
        head.runner = ph.HeadLayer(ph.layer_weights(t, prefix), shape, inv_freq, head.prepare, head.logits,
                                   target.max_length, getattr(target, "decode_kernels", None))
        return head

    def true_features(self, features: torch.Tensor) -> torch.Tensor:
        """The runner's tap layers side by side [n, U * H] -> g = fc([h_a ; h_b ; h_c]) [n, H]."""
        n = features.shape[0]
        if self._order != list(range(len(self._order))):
            features = features.view(n, len(self.tap_layers), -1)[:, self._order].reshape(n, -1)
        return F.linear(features.to(self.fc.dtype), self.fc, self.fc_bias)

    def fuse(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """g [n, H], next tokens [n] -> the layer's input [embedding ; g] [n, 2H] (its norms come inside)."""
        embeds = F.embedding(next_tokens.to(self.embed_weight.device), self.embed_weight)
        return torch.cat([embeds, features.to(embeds.dtype)], dim=-1)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """The layer's output [n, H] -> logits [n, V] float32 over the target's ids (-inf off the draft
        vocabulary)."""
        kernels = self.runner.kernels_for(features.shape[0])
        if kernels is not None and ph.gemv_fits(self.lm_head, features.shape[0]):  # the norm fused in
            draft = kernels.gemv(features.contiguous(), self.lm_head, norm_weight=self.norms["final"],
                                 eps=self.runner_eps, out_f32=True)
        else:
            normed = ph.rms_norm(features, self.norms["final"], self.runner_eps)
            draft = F.linear(normed, self.lm_head).float()
        if self.target_ids is None:
            return draft
        out = torch.full((features.shape[0], self.target.vocab_size), float("-inf"), device=draft.device)
        return out.index_copy_(1, self.target_ids, draft)

    @property
    def runner_eps(self) -> float:
        return self.runner.shape.eps
