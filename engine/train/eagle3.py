"""The EAGLE-3 head over a frozen target: fused low/middle/high features, training-time test and
self-distillation.

Inputs: the outputs of the target's tap layers (e.g. a low, a middle and the last one), side by side,
projected to the hidden size (`proj`); row t then reads fc(concat(feature_t, embed(token t+1))) into one
Llama decoder layer whose output, through the target's final norm and LM head, gives the distribution of
token t+2.

Training-time test: the head runs `steps` times over the whole window. Step 1 reads the projected target
features; step s+1 reads, at row t, the head's own step-s output of row t-1 (what it reads when drafting
token s+1 at inference), and attends to the true rows up to t-s and to its own earlier steps' rows of its
chain (t-s+1 .. t): exactly the cache the drafter has when it drafts autoregressively. Every step's loss is
the cross-entropy against the target's own distribution at that row (self-distillation: the head learns
what the target would say, not the corpus' next token), weighted by decay^(s-1).

Shapes: B = batch, T = window length, H = hidden size, V = vocabulary, n = number of tap layers.
The state dict's names follow the shipped head (`proj.weight`, `fc.weight`, `layer.<Llama layer keys>`), so
that engine/methods/eagle3/drafter.py runs the layer with the engine's Llama runner.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.train.heads import EAGLE_LAYER_KEYS, rope_theta
from engine.train.lm import autocast, chunks

HEAD_FILE = "eagle3_head.safetensors"
CONFIG_FILE = "eagle3_config.json"


def default_taps(num_layers: int) -> tuple:
    """A low, a middle and the last layer (fewer when the target has fewer layers)."""
    return tuple(sorted({0, num_layers // 2, num_layers - 1}))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


class _Attention(nn.Module):
    def __init__(self, H: int, heads: int, kv_heads: int, head_dim: int, inputs: int | None = None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        inputs = inputs or H   # the published EAGLE-3 layer's attention reads 2H
        self.q_proj = nn.Linear(inputs, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(inputs, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(inputs, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, H, bias=False)


class _MLP(nn.Module):
    def __init__(self, H: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One Llama decoder layer whose attention takes explicit keys/values and a mask (training-time test
    attends across steps)."""

    def __init__(self, H: int, heads: int, kv_heads: int, head_dim: int, inter: int, eps: float,
                 attn_inputs: int | None = None):
        super().__init__()
        self.self_attn = _Attention(H, heads, kv_heads, head_dim, attn_inputs)
        self.mlp = _MLP(H, inter)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.normed_inputs = attn_inputs is not None   # published: the caller normed the attention input

    def qkv(self, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """a [B, T, H] (published: the normed attention input [B, T, 2H]) -> q [B, heads, T, D], k and v
        [B, kv_heads, T, D] (rope on q and k)."""
        at = self.self_attn
        h = a if self.normed_inputs else self.input_layernorm(a)
        B, T, _ = h.shape
        q = at.q_proj(h).view(B, T, at.heads, at.head_dim).transpose(1, 2)
        k = at.k_proj(h).view(B, T, at.kv_heads, at.head_dim).transpose(1, 2)
        v = at.v_proj(h).view(B, T, at.kv_heads, at.head_dim).transpose(1, 2)
        return rope(q, cos, sin), rope(k, cos, sin), v

    def finish(self, a: torch.Tensor, q, keys, values, mask) -> torch.Tensor:
        """Attention of q over keys/values [B, kv_heads, S, D] with a bool mask [T, S], then o, the residual
        and the MLP."""
        at = self.self_attn
        group = at.heads // at.kv_heads
        if group > 1:
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)    # [B, heads, T, D]
        B, _, T, _ = out.shape
        x = a + at.o_proj(out.transpose(1, 2).reshape(B, T, at.heads * at.head_dim))
        return x + self.mlp(self.post_attention_layernorm(x))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, D] with cos/sin [T, D] (the rotate-half convention of Llama and engine.models.llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def ttt_mask(T: int, step: int, device) -> torch.Tensor:
    """[T, (step+1) T] bool: row t of step `step` (0-based) sees the true rows u <= t - step and, of each
    earlier step j = 1..step, the row t - step + j (its own chain)."""
    t = torch.arange(T, device=device)[:, None]
    u = torch.arange(T, device=device)[None, :]
    parts = [u <= t - step] + [u == t - step + j for j in range(1, step + 1)]
    return torch.cat(parts, dim=1)


class Eagle3Head(nn.Module):
    def __init__(self, hidden: int, tap_layers: tuple, heads: int, kv_heads: int, head_dim: int, inter: int,
                 eps: float, theta: float):
        super().__init__()
        self.tap_layers = tuple(int(i) for i in tap_layers)
        self.hidden, self.heads, self.kv_heads, self.head_dim = hidden, heads, kv_heads, head_dim
        self.inter, self.eps, self.theta = inter, eps, theta
        self.proj = nn.Linear(len(self.tap_layers) * hidden, hidden, bias=False)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = DecoderLayer(hidden, heads, kv_heads, head_dim, inter, eps)
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    @classmethod
    def for_target(cls, target_config, tap_layers: tuple, inter: int) -> "Eagle3Head":
        c = target_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(c.hidden_size, tap_layers, c.num_attention_heads, c.num_key_value_heads, head_dim, inter,
                   c.rms_norm_eps, float(rope_theta(c)))

    def rope_tables(self, T: int, device):
        freqs = torch.arange(T, device=device, dtype=torch.float32)[:, None] * self.inv_freq.to(device)[None]
        emb = torch.cat([freqs, freqs], dim=-1)                       # [T, D]
        return emb.cos(), emb.sin()

    def first_feature(self, taps: torch.Tensor) -> torch.Tensor:
        """The tap layers' outputs [B, T, n H] -> step 1's feature [B, T, H]."""
        return self.proj(taps)

    def layer_input(self, feature: torch.Tensor, embeds: torch.Tensor) -> tuple:
        """(the layer's input, its residual): fc(concat(feature, embedding)) both (the layer norms it)."""
        a = self.fc(torch.cat([feature, embeds], dim=-1))
        return a, a

    def draft_logits(self, target, h: torch.Tensor) -> torch.Tensor:
        """The layer's outputs -> logits over the target's vocabulary (the target's final norm and LM
        head)."""
        return target.lm_head(target.model.norm(h))

    @property
    def hook_layers(self) -> tuple:
        """The target layers whose outputs tapped_forward collects, in the order the head reads them."""
        return self.tap_layers

    def ttt(self, taps: torch.Tensor, embeds: torch.Tensor, steps: int) -> list:
        """taps [B, T, n H] (rows 0..T-1), embeds [B, T, H] (token t+1 at row t) -> the head's outputs of
        each step, [B, T, H] each (row t predicts token t+2 at every step; at step s it reads a feature s
        steps stale, and rows t < s have no valid chain)."""
        B, T, _ = embeds.shape
        cos, sin = self.rope_tables(T, embeds.device)
        feature = self.first_feature(taps)
        keys, values, outs = [], [], []
        for s in range(steps):
            attn_in, residual = self.layer_input(feature, embeds)
            q, k, v = self.layer.qkv(attn_in, cos, sin)
            keys.append(k)
            values.append(v)
            mask = ttt_mask(T, s, embeds.device)
            h = self.layer.finish(residual, q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask)
            outs.append(h)
            feature = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)   # row t reads row t-1
        return outs


@torch.no_grad()
def tapped_forward(target, ids: torch.Tensor, tap_layers: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] -> (the tap layers' outputs side by side [B, T, n H], logits [B, T, V])."""
    captured = {}
    handles = []
    for i in tap_layers:
        def grab(_module, _args, output, i=i):
            captured[i] = output[0] if isinstance(output, tuple) else output
        handles.append(target.model.layers[i].register_forward_hook(grab))
    try:
        logits = target(input_ids=ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    return torch.cat([captured[i] for i in tap_layers], dim=-1), logits


def soft_ce(teacher_logits: torch.Tensor, student_logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over valid rows of -sum p_teacher log q_student; logits [..., V], valid [...] bool."""
    p = torch.softmax(teacher_logits.float(), dim=-1)
    per_row = -(p * torch.log_softmax(student_logits.float(), dim=-1)).sum(-1)
    return (per_row * valid).sum() / valid.sum().clamp_min(1)


def step_weights(steps: int, decay: float) -> list:
    w = [decay ** s for s in range(steps)]
    return [x / sum(w) for x in w]


def eagle3_loss(head: Eagle3Head, target, w: torch.Tensor, steps: int, decay: float,
                metrics: dict | None = None) -> torch.Tensor:
    """w [B, T+1] token windows. Rows t = 0..T-2 read (taps_t, token t+1) and predict token t+2, whose
    target distribution is the target's logits at row t+1, at every step; step s (0-based) at row t is the
    (s+1)-th draft of the chain that starts at row t - s, so rows t < s are left out of step s's loss.
    metrics: when a dict, gets "agree": per step, [B, T-1] bool (head argmax == target argmax, valid rows)."""
    T = w.shape[1] - 1
    taps, logits = tapped_forward(target, w[:, :T], head.hook_layers)         # [B, T, nH], [B, T, V]
    n = T - 1
    embeds = target.model.embed_tokens(w[:, 1:T])                              # [B, n, H]
    outs = head.ttt(taps[:, :n], embeds, steps)
    teacher = logits[:, 1:T]                                                   # [B, n, V]
    rows = torch.arange(n, device=w.device)
    total = 0.0
    for s, (h, weight) in enumerate(zip(outs, step_weights(steps, decay))):
        student = head.draft_logits(target, h)                                 # [B, n, V]
        valid = (rows >= s)[None].expand(w.shape[0], n)
        total = total + weight * soft_ce(teacher, student, valid)
        if metrics is not None:
            agree = (student.argmax(-1) == teacher.argmax(-1)) & valid
            metrics.setdefault("agree", []).append(agree)
    return total


@torch.no_grad()
def eval_eagle3(head: Eagle3Head, target, windows: torch.Tensor, device, steps: int, decay: float,
                bs: int = 8) -> dict:
    """Loss and, per step, top-1 agreement with the target's argmax (`step{s}_top1`) and the share of chains
    whose steps 1..s all agree (`chain{s}_top1`: the greedy acceptance of a chain of s on this text, the
    fed tokens being the text's). Chain c has its step s at row c + s."""
    total, n = 0.0, 0
    hit = torch.zeros(steps)
    chain = torch.zeros(steps)
    count = 0
    for w in chunks(windows, bs):
        m: dict = {}
        with autocast(device):
            total += eagle3_loss(head, target, w, steps, decay, m).item() * len(w)
        n += len(w)
        chains = m["agree"][0].shape[1] - steps + 1
        ok = None
        for s, agree in enumerate(m["agree"]):
            a = agree[:, s: s + chains].cpu()
            ok = a if ok is None else ok & a
            hit[s] += a.sum().item()
            chain[s] += ok.sum().item()
        count += len(w) * chains
    out = {"eagle3_loss": total / max(1, n)}
    out.update({f"step{s + 1}_top1": (hit[s] / max(1, count)).item() for s in range(steps)})
    out.update({f"chain{s + 1}_top1": (chain[s] / max(1, count)).item() for s in range(steps)})
    return out


def eagle3_config(head: Eagle3Head) -> dict:
    return {"hidden_size": head.hidden, "num_attention_heads": head.heads,
            "num_key_value_heads": head.kv_heads, "intermediate_size": head.inter,
            "rope_theta": head.theta, "rms_norm_eps": head.eps, "head_dim": head.head_dim,
            "hidden_act": "silu", "tap_layers": list(head.tap_layers),
            "input": "proj(concat of the tap layers' outputs at row t) is row t's feature; the layer reads "
                     "fc(concat(feature_t, embed(token t+1))), rotary position t, causal; when drafting, "
                     "the head's own output of the previous row is the feature",
            "output": "the layer's output; the target's final norm and lm_head give token t+2",
            "training": "training-time test over several steps, cross-entropy against the target's own "
                        "distribution (self-distillation)"}


def save_eagle3(head: Eagle3Head, out_dir: Path, dtype=torch.float16) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {"proj.weight": head.proj.weight, "fc.weight": head.fc.weight}
    state.update({f"layer.{k}": v for k, v in head.layer.state_dict().items()})
    assert sorted(k[len("layer."):] for k in state if k.startswith("layer.")) == sorted(EAGLE_LAYER_KEYS), \
        sorted(state)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
    save_file(state, str(out_dir / HEAD_FILE), metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(eagle3_config(head), indent=2) + "\n")


def load_eagle3(dir_: Path) -> Eagle3Head:
    from safetensors.torch import load_file

    cfg = json.loads((Path(dir_) / CONFIG_FILE).read_text())
    head = Eagle3Head(cfg["hidden_size"], tuple(cfg["tap_layers"]), cfg["num_attention_heads"],
                      cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"],
                      cfg["rms_norm_eps"], cfg["rope_theta"])
    state = {k: v.float() for k, v in load_file(str(Path(dir_) / HEAD_FILE)).items()}
    head.proj.weight.data.copy_(state.pop("proj.weight"))
    head.fc.weight.data.copy_(state.pop("fc.weight"))
    head.layer.load_state_dict({k[len("layer."):]: v for k, v in state.items()})
    return head.eval()


# ------------------------------------------------------------------------------------------------------------
# The published EAGLE-3 architecture (engine/methods/eagle3/public.py runs it), trained by the same data and
# training-time-test loop: only the feature, the layer's input and the readout differ.

SPECULATORS_CONFIG = "config.json"
SPECULATORS_WEIGHTS = "model.safetensors"


def published_taps(num_layers: int) -> tuple:
    """The tapped layers as transformers' hidden_states[k] (the residual stream before layer k, k in
    1..L-1): the published default (2, L//2, L-3) where those are three distinct layers, else the layers
    after the ones default_taps reads (0, L//2, L-1 -> 1, L//2+1, and L-1 for the last, whose own output
    hidden_states[L] is already final-normed in transformers)."""
    L = num_layers
    default = (2, L // 2, L - 3)
    if len(set(default)) == 3 and all(1 <= k < L for k in default):
        return default
    return tuple(min(k + 1, L - 1) for k in (0, L // 2, L - 1))


class PublishedEagle3Head(Eagle3Head):
    """The published EAGLE-3 head: g = fc([h_a ; h_b ; h_c]) from hidden_states[k] of the tapped layers k, a
    layer whose attention reads [input_layernorm(embedding) ; hidden_norm(g)] (2H) with residual g, its
    own final norm and LM head (the full target vocabulary: d2t zeros). State-dict names are the speculators
    layout's (fc, layers.0.*, norm, lm_head)."""

    def __init__(self, hidden: int, taps: tuple, heads: int, kv_heads: int, head_dim: int, inter: int,
                 eps: float, theta: float, vocab: int):
        nn.Module.__init__(self)
        self.taps = tuple(int(k) for k in taps)   # hidden_states[k], as written in the config
        self.tap_layers = tuple(k - 1 for k in self.taps)   # the layers whose outputs those are
        self.hidden, self.heads, self.kv_heads, self.head_dim = hidden, heads, kv_heads, head_dim
        self.inter, self.eps, self.theta, self.vocab = inter, eps, theta, vocab
        self.fc = nn.Linear(len(self.taps) * hidden, hidden, bias=False)
        self.layer = DecoderLayer(hidden, heads, kv_heads, head_dim, inter, eps, attn_inputs=2 * hidden)
        self.layer.hidden_norm = RMSNorm(hidden, eps)
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    @classmethod
    def for_target(cls, target, taps: tuple, inter: int) -> "PublishedEagle3Head":
        """A head for this transformers target; its norm and LM head start as the target's."""
        c = target.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        head = cls(c.hidden_size, taps, c.num_attention_heads, c.num_key_value_heads, head_dim, inter,
                   c.rms_norm_eps, float(rope_theta(c)), c.vocab_size)
        with torch.no_grad():
            head.norm.weight.copy_(target.model.norm.weight)
            head.lm_head.weight.copy_(target.lm_head.weight)
        return head

    def first_feature(self, taps: torch.Tensor) -> torch.Tensor:
        return self.fc(taps)

    def layer_input(self, feature: torch.Tensor, embeds: torch.Tensor) -> tuple:
        """[input_layernorm(embedding) ; hidden_norm(g)] [.., 2H] and the residual g."""
        attn_in = torch.cat([self.layer.input_layernorm(embeds), self.layer.hidden_norm(feature)], dim=-1)
        return attn_in, feature

    def draft_logits(self, target, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    def state(self) -> dict:
        """The speculators layout's tensors (d2t zeros and t2d all true: the draft vocabulary is the
        target's)."""
        state = {"fc.weight": self.fc.weight, "norm.weight": self.norm.weight,
                 "lm_head.weight": self.lm_head.weight}
        state.update({f"layers.0.{k}": v for k, v in self.layer.state_dict().items()})
        state = {k: v.detach().cpu() for k, v in state.items()}
        state["d2t"] = torch.zeros(self.vocab, dtype=torch.int64)
        state["t2d"] = torch.ones(self.vocab, dtype=torch.bool)
        return state


def speculators_config(head: PublishedEagle3Head, verifier: str = "specplay shipped target",
                       speculative_tokens: int = 4) -> dict:
    """config.json of the speculators layout (speculators_model_type eagle3)."""
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_version": "0.2.0",
        "transformer_layer_config": {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": head.hidden,
            "num_attention_heads": head.heads, "num_key_value_heads": head.kv_heads,
            "head_dim": head.head_dim,
            "intermediate_size": head.inter, "hidden_act": "silu", "rms_norm_eps": head.eps,
            "rope_theta": head.theta, "max_position_embeddings": 1024, "vocab_size": head.vocab,
            "num_hidden_layers": 1, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False},
        "draft_vocab_size": head.vocab, "target_hidden_size": head.hidden, "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": list(head.taps),
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}},
        "specplay": {"training": "training-time test over several steps, cross-entropy against the target's "
                                 "own distribution (self-distillation), engine/train/eagle3.py",
                     "taps": "eagle_aux_hidden_state_layer_ids are transformers' hidden_states[k] (the "
                             "residual stream before layer k)"},
    }


def save_published(head: PublishedEagle3Head, out_dir: Path, dtype=torch.float16, **config) -> None:
    """The head in the speculators layout: config.json + model.safetensors."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in head.state().items()}
    save_file(state, str(out_dir / SPECULATORS_WEIGHTS), metadata={"format": "pt"})
    (out_dir / SPECULATORS_CONFIG).write_text(json.dumps(speculators_config(head, **config), indent=2) + "\n")


def load_published(dir_: Path) -> PublishedEagle3Head:
    from safetensors.torch import load_file

    cfg = json.loads((Path(dir_) / SPECULATORS_CONFIG).read_text())
    c = cfg["transformer_layer_config"]
    head = PublishedEagle3Head(c["hidden_size"], tuple(cfg["eagle_aux_hidden_state_layer_ids"]),
                               c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                               c["intermediate_size"], c["rms_norm_eps"], c["rope_theta"], c["vocab_size"])
    state = load_file(str(Path(dir_) / SPECULATORS_WEIGHTS))
    state.pop("d2t"), state.pop("t2d")
    head.fc.weight.data.copy_(state.pop("fc.weight").float())
    head.norm.weight.data.copy_(state.pop("norm.weight").float())
    head.lm_head.weight.data.copy_(state.pop("lm_head.weight").float())
    head.layer.load_state_dict({k[len("layers.0."):]: v.float() for k, v in state.items()})
    return head.eval()
