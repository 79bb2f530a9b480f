"""Llama-architecture target and draft: construction, data sampling, the optimisation loop, distillation
and the evaluations the model card reports.

Shapes: B = batch, T = sequence length, V = vocabulary, H = hidden size.
"""
from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.train.presets import ModelShape, StageSchedule

BOS_ID, EOS_ID, PAD_ID = 0, 1, 2


# ----------------------------------------------------------------------------- setup helpers

def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def autocast(device: torch.device):
    """bf16 autocast on CUDA (H200 tensor cores); plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def llama_config(shape: ModelShape, vocab_size: int, seq_len: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, head_dim=shape.hidden_size // shape.num_heads,
        max_position_embeddings=seq_len, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, initializer_range=0.02,
        hidden_act="silu", attention_bias=False, mlp_bias=False, use_cache=True,
    )


def build_lm(shape: ModelShape, vocab_size: int, seq_len: int):
    from transformers import LlamaForCausalLM

    config = llama_config(shape, vocab_size, seq_len)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def load_lm(path, device: torch.device):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(path), attn_implementation="sdpa", dtype=torch.float32)
    return model.to(device)


def count_params(module: nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


# ----------------------------------------------------------------------------- data

class TokenData:
    """Train/validation token streams on the device, random training windows, fixed validation windows."""

    def __init__(self, train: np.ndarray, val: np.ndarray, device: torch.device, seed: int):
        self.train = torch.from_numpy(train.astype(np.int64)).to(device)  # [N_train]
        self.val = torch.from_numpy(val.astype(np.int64)).to(device)      # [N_val]
        self.device = device
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, batch_size: int, seq_len: int) -> torch.Tensor:
        """Random windows [B, T+1] from the training stream."""
        starts = torch.randint(0, len(self.train) - seq_len - 1, (batch_size,), generator=self.gen)
        idx = starts.to(self.device)[:, None] + torch.arange(seq_len + 1, device=self.device)
        return self.train[idx]

    def val_windows(self, n: int, seq_len: int) -> torch.Tensor:
        """Up to n non-overlapping, evenly spaced validation windows [n, T+1] (the same every call)."""
        span = seq_len + 1
        fit = max(1, (len(self.val) - 1) // span)
        n = min(n, fit)
        starts = torch.linspace(0, (fit - 1) * span, n).long()
        idx = starts.to(self.device)[:, None] + torch.arange(span, device=self.device)
        return self.val[idx.clamp(max=len(self.val) - 1)]


def chunks(windows: torch.Tensor, size: int) -> Iterable[torch.Tensor]:
    for i in range(0, len(windows), size):
        yield windows[i:i + size]


# ----------------------------------------------------------------------------- optimisation loop

def lr_factor(step: int, progress: float, warmup: int) -> float:
    """Linear warm-up, then cosine to 10% of the peak as `progress` goes 0 -> 1."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(params: list[nn.Parameter], sched: StageSchedule, device: torch.device):
    """AdamW; weight decay on matrices only (not norms, biases)."""
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": sched.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=sched.lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=device.type == "cuda")


@dataclass
class RunResult:
    history: list = field(default_factory=list)   # [{"step", "train_loss", "lr", "elapsed_s", **eval}]
    steps_done: int = 0
    stopped_by_time: bool = False
    elapsed_s: float = 0.0
    best: Optional[dict] = None                   # eval dict of the kept (best) snapshot


def run_schedule(module: nn.Module, params: list[nn.Parameter], sched: StageSchedule,
                 loss_fn: Callable[[int], torch.Tensor], eval_fn: Callable[[], dict],
                 device: torch.device, log: Callable[[str], None], key: str = "val_loss") -> RunResult:
    """Optimise `params` with loss_fn(step); evaluate every eval_every steps and at the end; load back
    the snapshot with the lowest eval_fn()[key] (guards against over-fitting the small corpus)."""
    opt = make_optimizer(params, sched, device)
    res = RunResult()
    t0 = time.time()
    best_state, running, n_running = None, torch.zeros((), device=device), 0
    step = 0
    for step in range(sched.steps + 1):
        elapsed = time.time() - t0
        progress = max(step / sched.steps, elapsed / sched.time_budget_s)
        last = step == sched.steps or progress >= 1.0
        if step % sched.eval_every == 0 or last:
            module.eval()
            with torch.no_grad():
                ev = eval_fn()
            module.train()
            train_loss = (running / max(1, n_running)).item() if n_running else None
            row = {"step": step, "train_loss": train_loss, "elapsed_s": round(elapsed, 1), **ev}
            res.history.append(row)
            log(f"  step {step:5d}  train {train_loss if train_loss is None else round(train_loss, 4)}  "
                + "  ".join(f"{k} {v:.4f}" for k, v in ev.items() if isinstance(v, float)))
            running, n_running = torch.zeros((), device=device), 0
            if res.best is None or ev[key] <= res.best[key]:
                res.best = dict(ev, step=step)
                best_state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        if last:
            res.stopped_by_time = step < sched.steps
            break
        for g in opt.param_groups:
            g["lr"] = sched.lr * lr_factor(step, progress, sched.warmup_steps)
        with autocast(device):
            loss = loss_fn(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        running = running + loss.detach().float()
        n_running += 1
    res.steps_done = step
    res.elapsed_s = round(time.time() - t0, 1)
    if best_state is not None:
        module.load_state_dict(best_state)
    module.eval()
    return res


# ----------------------------------------------------------------------------- losses and metrics

def lm_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """[B, T] -> logits [B, T, V]."""
    return model(input_ids=ids, use_cache=False).logits


def lm_loss(model, windows: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of windows [B, T+1] (mean over B*T)."""
    logits = lm_logits(model, windows[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())


def kl_teacher_student(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_teacher || p_student) at T=1, mean over positions. Both [B, T, V]."""
    lp_t = F.log_softmax(teacher_logits.float(), dim=-1)
    lp_s = F.log_softmax(student_logits.float(), dim=-1)
    return (lp_t.exp() * (lp_t - lp_s)).sum(-1).mean()


@torch.no_grad()
def eval_lm(model, windows: torch.Tensor, device: torch.device, bs: int = 16) -> dict:
    """Validation loss and perplexity over windows [n, T+1]."""
    total, count = 0.0, 0
    for w in chunks(windows, bs):
        with autocast(device):
            logits = lm_logits(model, w[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    loss = total / count
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}


@torch.no_grad()
def eval_agreement(draft, target, windows: torch.Tensor, device: torch.device, bs: int = 16) -> dict:
    """Greedy top-1 agreement (argmax draft == argmax target) and KL(target || draft) per position."""
    agree, kl, count = 0, 0.0, 0
    for w in chunks(windows, bs):
        with autocast(device):
            lt = lm_logits(target, w[:, :-1])
            ld = lm_logits(draft, w[:, :-1])
        agree += (lt.argmax(-1) == ld.argmax(-1)).sum().item()
        kl += kl_teacher_student(lt, ld).item() * w[:, :-1].numel()
        count += w[:, :-1].numel()
    return {"top1_agreement": agree / count, "kl_target_draft": kl / count}


def unigram_loss(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of the validation stream under add-one-smoothed train unigram counts."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[val].mean())
