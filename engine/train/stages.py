"""The resumable training pipeline: one function per stage, each writing `<out>/<stage>/done.json` last.

A stage whose done.json exists is skipped, so an interrupted run continues where it stopped and the
stages can be spread over several machine sessions (carry `<out>` along).
"""
from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from engine.train import corpus, heads, lm
from engine.train import tokenizer as tk
from engine.train.presets import STAGES, Preset


@dataclass
class Context:
    preset: Preset
    out: Path
    device: torch.device
    export_dir: Path
    log: Callable[[str], None] = print
    _data: Optional[lm.TokenData] = field(default=None, repr=False)

    def stage_dir(self, stage: str) -> Path:
        return self.out / ("data" if stage == "tokenizer" else stage)

    @property
    def data(self) -> lm.TokenData:
        if self._data is None:
            d = self.stage_dir("tokenizer")
            self._data = lm.TokenData(np.load(d / "train.npy"), np.load(d / "val.npy"), self.device,
                                      self.preset.seed)
        return self._data

    def val_windows(self) -> torch.Tensor:
        return self.data.val_windows(self.preset.eval_windows, self.preset.seq_len)


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return f"1x {torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return f"CPU {platform.processor() or platform.machine()} (torch {torch.__version__})"


def is_done(ctx: Context, stage: str) -> bool:
    return (ctx.stage_dir(stage) / "done.json").exists()


def finish(ctx: Context, stage: str, metrics: dict, t0: float) -> dict:
    """Write metrics.json then done.json (the marker that the stage's checkpoint is complete)."""
    metrics = dict(metrics, stage=stage, wall_s=round(time.time() - t0, 1), hardware=hardware(ctx.device))
    d = ctx.stage_dir(stage)
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.json").write_text(json.dumps(metrics, indent=1))
    (d / "done.json").write_text(json.dumps({"stage": stage, "time": time.strftime("%Y-%m-%d %H:%M:%S")}))
    return metrics


def load_metrics(ctx: Context, stage: str) -> dict:
    return json.loads((ctx.stage_dir(stage) / "metrics.json").read_text())


def schedule_summary(res: lm.RunResult, tokens_per_step: int) -> dict:
    return {"history": res.history, "steps_done": res.steps_done, "stopped_by_time": res.stopped_by_time,
            "train_elapsed_s": res.elapsed_s, "best": res.best,
            "tokens_seen": res.steps_done * tokens_per_step,
            "tokens_per_s": round(res.steps_done * tokens_per_step / max(res.elapsed_s, 1e-9))}


# ----------------------------------------------------------------------------- stages

def stage_tokenizer(ctx: Context) -> dict:
    """Corpus -> manifest + held-out files -> BPE tokenizer -> uint16 token streams (train.npy, val.npy)."""
    t0, p, d = time.time(), ctx.preset, ctx.stage_dir("tokenizer")
    d.mkdir(parents=True, exist_ok=True)
    files = corpus.load_corpus(p.max_files, p.max_file_bytes, p.val_fraction)
    held = corpus.write_heldout(files, d, p.n_prompts, p.sample_bytes)
    train_texts = [f.text for f in files if f.split == "train"]
    val_texts = [f.text for f in files if f.split == "val"]
    tok = tk.train_bpe(train_texts, p.vocab_size)          # validation text never shapes the vocabulary
    tk.save_hf(tok, d / "tokenizer", model_max_length=p.seq_len)
    train_ids, val_ids = tk.encode_documents(tok, train_texts), tk.encode_documents(tok, val_texts)
    np.save(d / "train.npy", train_ids)
    np.save(d / "val.npy", val_ids)
    n_bytes = sum(len(t.encode("utf-8")) for t in train_texts)
    metrics = dict(held, vocab_size=tok.get_vocab_size(), train_tokens=int(len(train_ids)),
                   val_tokens=int(len(val_ids)), train_bytes=n_bytes,
                   bytes_per_token=round(n_bytes / max(1, len(train_ids)), 3),
                   roundtrip_exact=tk.roundtrip_ok(tok, val_texts),
                   unigram_val_loss=lm.unigram_loss(train_ids, val_ids, tok.get_vocab_size()))
    ctx.log(f"[tokenizer] {metrics['n_files']} files, {metrics['train_tokens']} train / "
            f"{metrics['val_tokens']} val tokens, {metrics['bytes_per_token']} bytes/token")
    return finish(ctx, "tokenizer", metrics, t0)


def pretrain(ctx: Context, stage: str, shape, sched, seed_offset: int) -> dict:
    """Next-token pre-training of one Llama model on the corpus (target or draft)."""
    t0, p = time.time(), ctx.preset
    lm.seed_all(p.seed + seed_offset)
    model = lm.build_lm(shape, p.vocab_size, p.seq_len).to(ctx.device).train()
    n_params = lm.count_params(model)
    ctx.log(f"[{stage}] {n_params:,} params ({2 * n_params / 1e6:.2f} MB fp16) on {hardware(ctx.device)}")
    params = [q for q in model.parameters()]
    val = ctx.val_windows()
    res = lm.run_schedule(
        model, params, sched,
        loss_fn=lambda step: lm.lm_loss(model, ctx.data.batch(sched.batch_size, p.seq_len)),
        eval_fn=lambda: lm.eval_lm(model, val, ctx.device), device=ctx.device, log=ctx.log)
    model.save_pretrained(str(ctx.stage_dir(stage) / "model"), safe_serialization=True)
    metrics = dict(schedule_summary(res, sched.batch_size * p.seq_len), params=n_params,
                   fp16_bytes=2 * n_params, **lm.eval_lm(model, val, ctx.device))
    return finish(ctx, stage, metrics, t0)


def stage_target(ctx: Context) -> dict:
    return pretrain(ctx, "target", ctx.preset.target, ctx.preset.target_sched, seed_offset=1)


def stage_draft(ctx: Context) -> dict:
    return pretrain(ctx, "draft", ctx.preset.draft, ctx.preset.draft_sched, seed_offset=2)


def load_target(ctx: Context):
    return heads.freeze(lm.load_lm(ctx.stage_dir("target") / "model", ctx.device))


def stage_distill(ctx: Context) -> dict:
    """Distil the pre-trained draft on the target's distributions: KL(target || draft) at T=1."""
    t0, p, sched = time.time(), ctx.preset, ctx.preset.distill_sched
    lm.seed_all(p.seed + 3)
    target = load_target(ctx)
    draft = lm.load_lm(ctx.stage_dir("draft") / "model", ctx.device).train()
    val = ctx.val_windows()

    def eval_fn() -> dict:
        return dict(lm.eval_lm(draft, val, ctx.device), **lm.eval_agreement(draft, target, val, ctx.device))

    def loss_fn(step: int) -> torch.Tensor:
        w = ctx.data.batch(sched.batch_size, p.seq_len)[:, :-1]
        with torch.no_grad():
            teacher = lm.lm_logits(target, w)
        return lm.kl_teacher_student(teacher, lm.lm_logits(draft, w))

    res = lm.run_schedule(draft, list(draft.parameters()), sched, loss_fn, eval_fn, ctx.device, ctx.log,
                          key="kl_target_draft")
    draft.save_pretrained(str(ctx.stage_dir("distill") / "model"), safe_serialization=True)
    before, after = res.history[0], eval_fn()
    metrics = dict(schedule_summary(res, sched.batch_size * p.seq_len),
                   before={k: before[k] for k in ("val_loss", "val_ppl", "top1_agreement",
                                                  "kl_target_draft")},
                   after=after)
    ctx.log(f"[distill] top-1 agreement {before['top1_agreement']:.4f} -> {after['top1_agreement']:.4f}")
    return finish(ctx, "distill", metrics, t0)


def stage_medusa(ctx: Context) -> dict:
    t0, p, sched = time.time(), ctx.preset, ctx.preset.medusa_sched
    lm.seed_all(p.seed + 4)
    target = load_target(ctx)
    H = target.config.hidden_size
    mh = heads.MedusaHeads(H, p.medusa_heads).to(ctx.device).train()
    val = ctx.val_windows()
    res = lm.run_schedule(
        mh, list(mh.parameters()), sched,
        loss_fn=lambda step: heads.medusa_loss(mh, target, ctx.data.batch(sched.batch_size, p.seq_len)),
        eval_fn=lambda: heads.eval_medusa(mh, target, val, ctx.device), device=ctx.device, log=ctx.log,
        key="mean_loss")
    final = heads.eval_medusa(mh, target, val, ctx.device)
    heads.save_medusa(mh, H, ctx.stage_dir("medusa"), dtype=torch.float32,
                      path_accuracy=final["path_accuracy"])
    metrics = dict(schedule_summary(res, sched.batch_size * p.seq_len), final=final,
                   params=lm.count_params(mh))
    return finish(ctx, "medusa", metrics, t0)


def stage_eagle(ctx: Context) -> dict:
    t0, p, sched = time.time(), ctx.preset, ctx.preset.eagle_sched
    lm.seed_all(p.seed + 5)
    target = load_target(ctx)
    head = heads.EagleHead(heads.eagle_llama_config(target.config)).to(ctx.device).train()
    val = ctx.val_windows()
    w_ce = p.eagle_ce_weight

    def eval_fn() -> dict:
        return {"eagle_loss": heads.eval_eagle_loss(head, target, val, ctx.device, w_ce),
                **heads.eval_eagle(head, target, val, ctx.device)}

    res = lm.run_schedule(
        head, list(head.parameters()), sched,
        loss_fn=lambda step: heads.eagle_loss(head, target, ctx.data.batch(sched.batch_size, p.seq_len),
                                              w_ce),
        eval_fn=eval_fn, device=ctx.device, log=ctx.log, key="eagle_loss")
    heads.save_eagle(head, ctx.stage_dir("eagle"), dtype=torch.float32)
    metrics = dict(schedule_summary(res, sched.batch_size * p.seq_len), final=eval_fn(),
                   params=lm.count_params(head), ce_weight=w_ce)
    return finish(ctx, "eagle", metrics, t0)


def stage_export(ctx: Context) -> dict:
    from engine.train import export

    t0 = time.time()
    finished = {s: load_metrics(ctx, s) for s in STAGES[:-1] if (ctx.stage_dir(s) / "metrics.json").exists()}
    report = export.export_all(ctx, finished)
    return finish(ctx, "export", {"export_dir": str(ctx.export_dir), "files": report["files"]}, t0)


RUNNERS = {"tokenizer": stage_tokenizer, "target": stage_target, "draft": stage_draft,
           "distill": stage_distill, "medusa": stage_medusa, "eagle": stage_eagle, "export": stage_export}


def run_stages(ctx: Context, stages: list[str]) -> None:
    """Run the requested stages in pipeline order, skipping finished ones (export always re-runs)."""
    for stage in STAGES:
        if stage not in stages:
            continue
        if stage != "export" and is_done(ctx, stage):
            ctx.log(f"[{stage}] checkpoint found in {ctx.stage_dir(stage)}: skipped")
            continue
        ctx.log(f"[{stage}] start")
        m = RUNNERS[stage](ctx)
        ctx.log(f"[{stage}] done in {m['wall_s']} s")
