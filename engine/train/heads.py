"""Medusa heads and the EAGLE head over a frozen target.

Both read the target's hidden states; the target (embeddings, final norm, lm_head) never changes.
Shapes: B = batch, T = window length, H = hidden size, V = vocabulary.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.train.lm import autocast, chunks

EAGLE_LAYER_KEYS = [
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
]


# ----------------------------------------------------------------------------- target features

@torch.no_grad()
def target_features(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] -> (f [B, T, H] last decoder layer output before the final norm,
    x [B, T, H] after the final norm, i.e. what the lm_head reads)."""
    captured = {}

    def grab(_module, args):
        captured["f"] = args[0]

    handle = target.model.norm.register_forward_pre_hook(grab)
    try:
        x = target.model(input_ids=ids, use_cache=False).last_hidden_state
    finally:
        handle.remove()
    return captured["f"], x


def freeze(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.requires_grad_(False)
    return module.eval()


# ----------------------------------------------------------------------------- Medusa

class MedusaHeads(nn.Module):
    """Head k (k = 1..n) maps x_t to h = x_t + SiLU(W_k x_t + b_k), with a second block (layers = 2) then
    h + SiLU(V_k h + c_k); lm_head(h) predicts token t+1+k."""

    def __init__(self, hidden_size: int, num_heads: int, layers: int = 1):
        super().__init__()
        if layers not in (1, 2):
            raise ValueError(f"Medusa heads have 1 or 2 blocks, not {layers}")
        self.heads = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        self.second = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads)
                                    if layers == 2)
        for h in (*self.heads, *self.second):   # zero init: every head starts as the plain next-token LM head
            nn.init.zeros_(h.weight)
            nn.init.zeros_(h.bias)

    @property
    def layers(self) -> int:
        return 2 if len(self.second) else 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [n, ..., H]."""
        outs = [x + F.silu(h(x)) for h in self.heads]
        if len(self.second):
            outs = [h + F.silu(block(h)) for h, block in zip(outs, self.second)]
        return torch.stack(outs)


RANKS = 6  # candidates per head that a Medusa tree may use
PATHS_KEPT = 64  # the most often right paths saved with the heads (a tree has at most 64 nodes)


def medusa_config(heads: MedusaHeads, hidden_size: int, path_accuracy: list | None = None) -> dict:
    n = len(heads.heads)
    residual = "h = x + SiLU(W x + b)" + ("; h = h + SiLU(V h + c) (the second block)" if heads.layers == 2
                                         else "")
    config = {"num_heads": n, "hidden_size": hidden_size, "layers": heads.layers,
              "offsets": [k + 1 for k in range(1, n + 1)],
              "offsets_meaning": "head k-1 reads the final-normed hidden state at position t and predicts "
                                 "the token at t+offset (the lm_head itself predicts t+1)",
              "residual": residual + "; logits = target.lm_head(h)"}
    if path_accuracy is not None:
        config["path_accuracy"] = [[list(path), round(chance, 6)] for path, chance in path_accuracy]
        config["path_accuracy_meaning"] = (
            "[[r_1, ..., r_d], f]: on held-out text, the fraction of positions where the rank-r_1 candidate "
            "of head 1 and ... and the rank-r_d candidate of head d were all right; the drafter's tree is "
            "the top entries")
    return config


def path_hits(hits: torch.Tensor) -> dict:
    """hits [D, R, P] bool: head d's rank-r candidate is right at position p -> {(r_1, ..., r_d): the number
    of positions where every step of that path is right}, for the paths right at least once."""
    hits = hits.cpu()
    counts: dict = {}

    def grow(prefix: tuple, right: torch.Tensor) -> None:
        for rank in range(hits.shape[1]):
            both = right & hits[len(prefix), rank]
            count = int(both.sum())
            if count:
                counts[prefix + (rank,)] = count
                if len(prefix) + 1 < hits.shape[0]:
                    grow(prefix + (rank,), both)

    grow((), torch.ones(hits.shape[2], dtype=torch.bool))
    return counts


def top_paths(counts: dict, positions: int, keep: int = PATHS_KEPT) -> list:
    """The `keep` most often right paths as [(path, fraction)], best first; ties go to the shorter path, so a
    path's parent always comes before it (a parent is right wherever its child is)."""
    best = sorted(counts.items(), key=lambda item: (-item[1], len(item[0]), item[0]))[:keep]
    return [(path, count / positions) for path, count in best]


def medusa_loss(heads: MedusaHeads, target, w: torch.Tensor) -> torch.Tensor:
    """w [B, T+1]: mean over heads of CE(lm_head(head_k(x_t)), w[t+1+k])."""
    T = w.shape[1] - 1
    _, x = target_features(target, w[:, :T])           # [B, T, H]
    hs = heads(x)                                        # [n, B, T, H]
    losses = []
    for i in range(hs.shape[0]):
        k = i + 1
        logits = target.lm_head(hs[i, :, : T - k])         # [B, T-k, V]
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), w[:, 1 + k:].flatten()))
    return torch.stack(losses).mean()


def medusa_distill_loss(heads: MedusaHeads, target, w: torch.Tensor) -> torch.Tensor:
    """Self-distillation (Medusa-2 style, the target frozen): head k at row t learns the target's own
    distribution of token t+1+k, i.e. the target's logits at row t+k, by cross-entropy against it (mean over
    heads and rows). w [B, T+1]; only w[:, :T] is read."""
    T = w.shape[1] - 1
    _, x = target_features(target, w[:, :T])            # [B, T, H]
    with torch.no_grad():
        teacher = torch.softmax(target.lm_head(x).float(), dim=-1)   # [B, T, V]
    hs = heads(x)                                          # [n, B, T, H]
    losses = []
    for i in range(hs.shape[0]):
        k = i + 1
        logits = target.lm_head(hs[i, :, : T - k]).float()             # [B, T-k, V]
        losses.append(-(teacher[:, k:] * torch.log_softmax(logits, dim=-1)).sum(-1).mean())
    return torch.stack(losses).mean()


@torch.no_grad()
def greedy_examples(target, rows: torch.Tensor, prompt_len: int, depth: int, bs: int = 32) -> tuple:
    """rows [N, T]: prompts of prompt_len tokens and the target's greedy continuations -> (x [M, H] the
    final-normed feature at every position t from the prompt's last token to the last with all its labels,
    labels [M, depth] the text's tokens t+2 .. t+1+depth). A greedy round drafting from t accepts head d's
    token when it is the text's token t+1+d (t+1, the round's root, is the target's own argmax at t)."""
    T = rows.shape[1]
    n = T - prompt_len - depth  # positions per row
    if n <= 0:
        raise ValueError(f"rows of {T} tokens leave no position with {depth} labels after a "
                         f"{prompt_len}-token prompt")
    xs, labels = [], []
    for chunk in chunks(rows, bs):
        _, x = target_features(target, chunk[:, :prompt_len - 1 + n])           # [B, prompt_len-1+n, H]
        xs.append(x[:, prompt_len - 1:].float().flatten(0, 1))                  # [B * n, H]
        first = prompt_len + 1  # head 1's label of position prompt_len - 1
        ahead = [chunk[:, first + d:first + d + n] for d in range(depth)]      # depth x [B, n]
        labels.append(torch.stack(ahead, -1).flatten(0, 1))
    return torch.cat(xs), torch.cat(labels)


def greedy_examples_of(target, texts: list, depth: int, bs: int = 32) -> tuple:
    """greedy_examples over texts [(ids [P + N], P)] of any prompt lengths P (N alike): the texts of one
    prompt length go through greedy_examples together; their positions are concatenated in that order."""
    groups: dict = {}
    for ids, prompt_len in texts:
        groups.setdefault((prompt_len, len(ids)), []).append(ids)
    parts = [greedy_examples(target, torch.stack(rows), prompt_len, depth, bs)
             for (prompt_len, _), rows in sorted(groups.items())]
    return torch.cat([x for x, _ in parts]), torch.cat([labels for _, labels in parts])


def medusa_greedy_loss(heads: MedusaHeads, target, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """x [M, H] final-normed features, labels [M, D]: the mean over heads d of
    CE(lm_head(head_d(x)), labels[:, d])."""
    hs = heads(x)                                          # [D, M, H]
    logits = target.lm_head(hs).float()                    # [D, M, V]
    return F.cross_entropy(logits.flatten(0, 1), labels.T.flatten())


@torch.no_grad()
def eval_medusa(heads: MedusaHeads, target, windows: torch.Tensor, device, bs: int = 8) -> dict:
    """Per-head top-1 / top-5 accuracy and loss over validation windows [n, T+1], and `path_accuracy`: how
    often each path of head candidates is right all the way (see top_paths), over the positions every head can
    see."""
    n = len(heads.heads)
    hit1, hit5, loss, count = [0] * n, [0] * n, [0.0] * n, [0] * n
    paths: dict = {}
    positions = 0
    for w in chunks(windows, bs):
        T = w.shape[1] - 1
        shared = T - n  # positions t < T - n have a label for every head
        hits = []  # n x [RANKS, B * shared]
        with autocast(device):
            _, x = target_features(target, w[:, :T])
            hs = heads(x)
            for i in range(n):
                k = i + 1
                logits = target.lm_head(hs[i, :, : T - k]).float()   # [B, T-k, V]
                labels = w[:, 1 + k:]                                # [B, T-k]
                right = logits.topk(RANKS, dim=-1).indices == labels[..., None]  # [B, T-k, RANKS]
                hit1[i] += right[..., 0].sum().item()
                hit5[i] += right[..., :5].any(-1).sum().item()
                hits.append(right[:, :shared].flatten(0, 1).T)
                loss[i] += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").item()
                count[i] += labels.numel()
        for path, hit_count in path_hits(torch.stack(hits)).items():
            paths[path] = paths.get(path, 0) + hit_count
        positions += w.shape[0] * shared
    return dict(head_figures(hit1, hit5, loss, count), path_accuracy=top_paths(paths, positions))


def head_figures(hit1: list, hit5: list, loss: list, count: list) -> dict:
    """Per head d: top-1 and top-5 accuracy and mean loss from its sums over count[d] labels; mean_loss over
    the heads."""
    out = {}
    for i in range(len(count)):
        out[f"head{i + 1}_top1"] = hit1[i] / count[i]
        out[f"head{i + 1}_top5"] = hit5[i] / count[i]
        out[f"head{i + 1}_loss"] = loss[i] / count[i]
    out["mean_loss"] = sum(loss[i] / count[i] for i in range(len(count))) / len(count)
    return out


@torch.no_grad()
def eval_medusa_greedy(heads: MedusaHeads, target, x: torch.Tensor, labels: torch.Tensor,
                       bs: int = 4096) -> dict:
    """eval_medusa's figures over greedy_examples' positions (x [M, H], labels [M, D]): per-head top-1, top-5
    and loss against the greedy text, and path_accuracy over every position (all heads have labels there)."""
    n = labels.shape[1]
    hit1, hit5, loss, hits = [0] * n, [0] * n, [0.0] * n, []
    for start in range(0, len(x), bs):
        xs, ys = x[start:start + bs], labels[start:start + bs]
        logits = target.lm_head(heads(xs)).float()                                # [D, m, V]
        right = logits.topk(RANKS, dim=-1).indices == ys.T[..., None]              # [D, m, RANKS]
        for i in range(n):
            hit1[i] += int(right[i, :, 0].sum())
            hit5[i] += int(right[i, :, :5].any(-1).sum())
            loss[i] += F.cross_entropy(logits[i], ys[:, i], reduction="sum").item()
        hits.append(right.transpose(1, 2))                                          # [D, RANKS, m]
    return dict(head_figures(hit1, hit5, loss, [len(x)] * n),
                path_accuracy=top_paths(path_hits(torch.cat(hits, -1)), len(x)))


def save_medusa(heads: MedusaHeads, hidden_size: int, out_dir: Path, dtype=torch.float16,
                path_accuracy: list | None = None, int8: bool = False) -> None:
    """The heads' weights in dtype, or with int8 = True their matrices as int8 with one `.weight_scale` a
    row (dtype) and their biases in dtype: half the bytes; the drafter dequantises them at load."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, value in heads.state_dict().items():
        value = value.detach().to("cpu", torch.float32)
        if int8 and name.endswith(".weight"):
            state[name], state[name + "_scale"] = quantize_rows(value)
            state[name + "_scale"] = state[name + "_scale"].to(dtype)
        else:
            state[name] = value.to(dtype).contiguous()
    save_file(state, str(out_dir / "medusa_heads.safetensors"), metadata={"format": "pt"})
    cfg = medusa_config(heads, hidden_size, path_accuracy)
    (out_dir / "medusa_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def quantize_rows(weight: torch.Tensor) -> tuple:
    """weight [R, C] -> (int8 [R, C], scale [R]) with weight ~ int8 * scale[:, None] (symmetric, per row)."""
    scale = weight.abs().amax(1).clamp_min(1e-12) / 127
    return (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous(), scale


def load_medusa(dir_: Path) -> MedusaHeads:
    from safetensors.torch import load_file

    cfg = json.loads((dir_ / "medusa_config.json").read_text())
    heads = MedusaHeads(cfg["hidden_size"], cfg["num_heads"], cfg.get("layers", 1))
    from engine.methods.medusa.drafter import dequantized_weight

    state = load_file(str(dir_ / "medusa_heads.safetensors"))
    heads.load_state_dict({
        name: dequantized_weight(state, name[:-len(".weight")], torch.float32) if name.endswith(".weight")
        else value.float()
        for name, value in state.items() if not name.endswith("_scale")})
    return heads


def medusa_path_accuracy(dir_: Path) -> list | None:
    """The path accuracies saved beside the heads as [(path, fraction)], or None (not measured)."""
    saved = json.loads((Path(dir_) / "medusa_config.json").read_text()).get("path_accuracy")
    return None if saved is None else [(tuple(path), chance) for path, chance in saved]


# ----------------------------------------------------------------------------- EAGLE

def eagle_llama_config(target_config):
    """A one-layer copy of the target's config (same widths, heads, rope and eps)."""
    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = 1
    cfg._attn_implementation = "sdpa"
    return cfg


class EagleHead(nn.Module):
    """Row t reads concat(f_t, e_{t+1}) -> fc -> one causal Llama decoder layer -> predicted f_{t+1}."""

    def __init__(self, llama_cfg):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        H = llama_cfg.hidden_size
        self.config = llama_cfg
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layer = LlamaDecoderLayer(llama_cfg, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(config=llama_cfg)   # buffers only, not saved

    def forward(self, feats: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """feats [B, n, H], embeds [B, n, H], position_ids [B, n] -> predicted next features [B, n, H]."""
        h = self.fc(torch.cat([feats, embeds], dim=-1))
        cos_sin = self.rotary(h, position_ids)
        out = self.layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=cos_sin,
                         use_cache=False)
        return out[0] if isinstance(out, tuple) else out


def eagle_config(head: EagleHead) -> dict:
    c = head.config
    return {"hidden_size": c.hidden_size, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "intermediate_size": c.intermediate_size,
            "rope_theta": float(rope_theta(c)), "rms_norm_eps": c.rms_norm_eps, "head_dim": head_dim(c),
            "hidden_act": "silu",
            "input": "row t = fc(concat(f_t, embed(token t+1))), rotary position of row t = t; causal",
            "output": "predicted f_{t+1} (last decoder layer output before the target's final norm)"}


def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def rope_theta(cfg) -> float:
    """rope_theta moved into rope_parameters in transformers 5."""
    params = getattr(cfg, "rope_parameters", None) or {}
    return params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))


def positions(batch: int, n: int, device) -> torch.Tensor:
    return torch.arange(n, device=device)[None].expand(batch, n)


def eagle_loss(head: EagleHead, target, w: torch.Tensor, ce_weight: float) -> torch.Tensor:
    """w [B, T+1]. Rows t = 0..T-2:
    smooth-L1(pred_t, f_{t+1}) + ce_weight * CE(lm_head(norm(pred_t)), w[t+2])."""
    T = w.shape[1] - 1
    f, _ = target_features(target, w[:, :T])                            # [B, T, H]
    emb = target.model.embed_tokens(w[:, 1:T])                          # [B, T-1, H]
    pred = head(f[:, : T - 1], emb, positions(w.shape[0], T - 1, w.device))
    reg = F.smooth_l1_loss(pred.float(), f[:, 1:T].float())
    logits = target.lm_head(target.model.norm(pred))                     # [B, T-1, V]
    ce = F.cross_entropy(logits.float().flatten(0, 1), w[:, 2:].flatten())
    return reg + ce_weight * ce


@torch.no_grad()
def eval_eagle(head: EagleHead, target, windows: torch.Tensor, device, steps: int = 4,
               n_anchors: int = 8, bs: int = 16) -> dict:
    """Autoregressive next-token accuracy. For anchor a, rows 0..a use the target's true features;
    step s predicts token a+1+s, and step s+1 appends (predicted feature, predicted token's embedding).
    Reports per-step accuracy and the chain accuracy (steps 1..s all right)."""
    hit = torch.zeros(steps)
    chain = torch.zeros(steps)
    total = 0
    for w in chunks(windows, bs):
        B, T = w.shape[0], w.shape[1] - 1
        with autocast(device):
            f, _ = target_features(target, w[:, :T])
            anchors = torch.linspace(T // 8, T - 1 - steps, n_anchors).long().unique().tolist()
            for a in anchors:
                feats, toks = f[:, : a + 1], w[:, 1: a + 2]              # [B, a+1, H], [B, a+1]
                ok = torch.ones(B, dtype=torch.bool, device=w.device)
                for s in range(steps):
                    n = feats.shape[1]
                    pred = head(feats, target.model.embed_tokens(toks), positions(B, n, w.device))[:, -1:]
                    tok = target.lm_head(target.model.norm(pred)).argmax(-1)   # [B, 1]
                    right = tok[:, 0] == w[:, a + 2 + s]
                    ok &= right
                    hit[s] += right.sum().item()
                    chain[s] += ok.sum().item()
                    feats = torch.cat([feats, pred.to(feats.dtype)], 1)
                    toks = torch.cat([toks, tok], 1)
                total += B
    out = {f"step{s + 1}_top1": (hit[s] / total).item() for s in range(steps)}
    out.update({f"chain{s + 1}_top1": (chain[s] / total).item() for s in range(steps)})
    return out


@torch.no_grad()
def eval_eagle_loss(head: EagleHead, target, windows: torch.Tensor, device, ce_weight: float,
                    bs: int = 16) -> float:
    total, n = 0.0, 0
    for w in chunks(windows, bs):
        with autocast(device):
            total += eagle_loss(head, target, w, ce_weight).item() * len(w)
        n += len(w)
    return total / n


def save_eagle(head: EagleHead, out_dir: Path, dtype=torch.float16) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {"fc.weight": head.fc.weight}
    state.update({f"layer.{k}": v for k, v in head.layer.state_dict().items()})
    assert sorted(k[len("layer."):] for k in state if k.startswith("layer.")) == sorted(EAGLE_LAYER_KEYS), \
        sorted(state)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
    save_file(state, str(out_dir / "eagle_head.safetensors"), metadata={"format": "pt"})
    (out_dir / "eagle_config.json").write_text(json.dumps(eagle_config(head), indent=2) + "\n")


def load_eagle(dir_: Path, target_config) -> EagleHead:
    from safetensors.torch import load_file

    head = EagleHead(eagle_llama_config(target_config))
    state = {k: v.float() for k, v in load_file(str(dir_ / "eagle_head.safetensors")).items()}
    head.fc.weight.data.copy_(state.pop("fc.weight"))
    head.layer.load_state_dict({k[len("layer."):]: v for k, v in state.items()})
    return head.eval()
