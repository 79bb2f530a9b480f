"""The resumable training pipeline: one function per stage, each writing `<out>/<stage>/done.json` last.

A stage whose done.json exists is skipped, so an interrupted run continues where it stopped and the
stages can be spread over several machine sessions (carry `<out>` along).

With `Context.family_dir` (an exported family, e.g. assets/models) the tokenizer and target stages take that
family's tokenizer and target instead of training them, so that heads can be retrained on a shipped target.
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
from tokenizers import Tokenizer

from engine.errors import SpecplayError
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
    baseline_dir: Optional[Path] = None   # a family to evaluate beside the new one (the eval stage)
    family_dir: Optional[Path] = None     # take the tokenizer and the target from this exported family
    _data: Optional[lm.TokenData] = field(default=None, repr=False)
    _gen: Optional[dict] = field(default=None, repr=False)

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

    @property
    def head_len(self) -> int:
        return self.preset.head_seq_len or self.preset.seq_len

    def head_val_windows(self) -> torch.Tensor:
        """Validation windows [n, head_len+1] of the corpus, for the heads."""
        return self.data.val_windows(self.preset.eval_windows, self.head_len)

    def generated(self, split: str) -> Optional[torch.Tensor]:
        """The target's own text [N, head_len+1] on the device (selfgen stage), or None when not made."""
        if self._gen is None:
            d = self.stage_dir("selfgen")
            self._gen = {}
            for name in ("train", "val"):
                f = d / f"{name}.npy"
                if (d / "done.json").exists() and f.exists():
                    arr = np.load(f).astype(np.int64)
                    self._gen[name] = torch.from_numpy(arr).to(self.device) if len(arr) else None
        return self._gen.get(split)

    def head_batch(self, batch_size: int) -> torch.Tensor:
        """[B, head_len+1]: corpus windows, and a gen_fraction share of the target's own text."""
        gen = self.generated("train")
        n_gen = 0 if gen is None else int(round(batch_size * self.preset.gen_fraction))
        parts = []
        if n_gen:
            rows = torch.randint(0, len(gen), (n_gen,), generator=self.data.gen).to(self.device)
            parts.append(gen[rows, : self.head_len + 1])
        if batch_size - n_gen:
            parts.append(self.data.batch(batch_size - n_gen, self.head_len))
        return torch.cat(parts)

    def head_eval_sets(self) -> dict:
        """{"corpus": validation windows, "generated": the target's greedy held-out text (when made)}."""
        sets = {"corpus": self.head_val_windows()}
        gen = self.generated("val")
        if gen is not None:
            sets["generated"] = gen[:, : self.head_len + 1]
        return sets


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


# ----------------------------------------------------------------------------- a shipped family

FAMILY_FILES = ("config.json", "model.safetensors", "tokenizer.json")   # what the family's target/ must hold
FAMILY_STAGES = ("tokenizer", "target")                                 # the stages that take from it


def family_tokenizer(family: Path) -> Path:
    return Path(family) / "target" / "tokenizer.json"


def family_mismatches(family: Path, p: Preset) -> list[str]:
    """Where the family's target config and tokenizer disagree with what the preset trains ([]: nowhere)."""
    cfg = json.loads((Path(family) / "target" / "config.json").read_text())
    s = p.target
    want = {"vocab_size": p.vocab_size, "hidden_size": s.hidden_size, "num_hidden_layers": s.num_layers,
            "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads,
            "intermediate_size": s.intermediate_size, "max_position_embeddings": p.seq_len}
    bad = [f"{k} {cfg.get(k)} (preset {v})" for k, v in want.items() if cfg.get(k) != v]
    tok = Tokenizer.from_file(str(family_tokenizer(family)))
    if tok.get_vocab_size() > p.vocab_size:
        bad.append(f"tokenizer vocabulary {tok.get_vocab_size()} (preset {p.vocab_size})")
    specials = [tok.token_to_id(t) for t in tk.SPECIALS]
    if specials != list(range(len(tk.SPECIALS))):
        bad.append(f"special token ids {dict(zip(tk.SPECIALS, specials))} (expected 0..{len(specials) - 1})")
    return bad


def check_family(ctx: Context) -> None:
    """Refuse a family that the preset does not describe, and an --out whose finished tokenizer or target
    stage did not come from this family (it would be reused as it is)."""
    family = Path(ctx.family_dir)
    missing = [f"target/{name}" for name in FAMILY_FILES if not (family / "target" / name).exists()]
    if missing:
        raise SpecplayError(f"{family}: no {', '.join(missing)} (not an exported family like assets/models)")
    bad = family_mismatches(family, ctx.preset)
    if bad:
        raise SpecplayError(f"{family}/target does not match the {ctx.preset.name!r} preset: "
                            f"{'; '.join(bad)} (a family made with --tiny needs --tiny, the shipped one the "
                            "full preset)")
    for stage in FAMILY_STAGES:
        if not is_done(ctx, stage):
            continue
        came = load_metrics(ctx, stage).get("from_family")
        if came is None or Path(came).resolve() != family.resolve():
            raise SpecplayError(f"{ctx.stage_dir(stage)} is a finished {stage} stage not taken from {family} "
                                f"({'trained' if came is None else 'from ' + came}); use a fresh --out")


# ----------------------------------------------------------------------------- stages

def stage_tokenizer(ctx: Context) -> dict:
    """Corpus -> manifest + held-out files -> BPE tokenizer (trained, or the family's) -> uint16 token streams
    (train.npy, val.npy)."""
    t0, p, d = time.time(), ctx.preset, ctx.stage_dir("tokenizer")
    d.mkdir(parents=True, exist_ok=True)
    info = None
    if p.corpus == "stdlib":
        files = corpus.load_corpus(p.max_files, p.max_file_bytes, p.val_fraction)
    elif p.corpus == "stdlib+packages":
        files, info = corpus.build_corpus(p.max_file_bytes, p.val_fraction, p.max_package_bytes)
        if p.max_files is not None:
            keep = set(corpus.choose_subset([f.rel for f in files], p.max_files))
            files = [f for f in files if f.rel in keep]
    else:
        raise ValueError(f"unknown corpus {p.corpus!r}")
    ctx.log(f"[tokenizer] corpus: {len(files)} files ({time.time() - t0:.1f} s)"
            + ("" if info is None else f"; {len(info['included'])} packages, {len(info['skipped'])} skipped, "
               f"dropped {info['dropped']}"))
    held = corpus.write_heldout(files, d, p.n_prompts, p.sample_bytes, info)
    train_files = [f for f in files if f.split == "train"]
    val_files = [f for f in files if f.split == "val"]
    train_texts = [f.text for f in train_files]
    val_texts = [f.text for f in val_files]
    if ctx.family_dir is None:
        tok, origin = train_tokenizer(ctx, train_files)
    else:
        path = family_tokenizer(ctx.family_dir)
        tok, origin = Tokenizer.from_file(str(path)), {"from_family": str(ctx.family_dir)}
        ctx.log(f"[tokenizer] the family's tokenizer {path} (no BPE training)")
    tk.save_hf(tok, d / "tokenizer", model_max_length=p.seq_len)
    t1 = time.time()
    train_lens: list = []
    val_lens: list = []
    train_ids = tk.encode_documents(tok, train_texts, train_lens)
    val_ids = tk.encode_documents(tok, val_texts, val_lens)
    ctx.log(f"[tokenizer] encoded in {time.time() - t1:.1f} s")
    np.save(d / "train.npy", train_ids)
    np.save(d / "val.npy", val_ids)
    tokens_by_source: dict = {}
    for f, n in zip(train_files + val_files, train_lens + val_lens):
        tokens_by_source[f.source] = tokens_by_source.get(f.source, 0) + n
    n_bytes = sum(len(t.encode("utf-8")) for t in train_texts)
    metrics = dict(held, vocab_size=tok.get_vocab_size(), train_tokens=int(len(train_ids)),
                   val_tokens=int(len(val_ids)), train_bytes=n_bytes,
                   bytes_per_token=round(n_bytes / max(1, len(train_ids)), 3),
                   roundtrip_exact=tk.roundtrip_ok(tok, val_texts[:200]),
                   unigram_val_loss=lm.unigram_loss(train_ids, val_ids, tok.get_vocab_size()),
                   corpus=p.corpus, sources=corpus.source_table(files, tokens_by_source), **origin)
    if info is not None:
        metrics.update(packages=info["included"], skipped_packages=info["skipped"],
                       dropped_files=info["dropped"])
    ctx.log(f"[tokenizer] {metrics['n_files']} files, {metrics['train_tokens']} train / "
            f"{metrics['val_tokens']} val tokens, {metrics['bytes_per_token']} bytes/token")
    return finish(ctx, "tokenizer", metrics, t0)


def train_tokenizer(ctx: Context, train_files: list) -> tuple[Tokenizer, dict]:
    """A byte-level BPE on the training files (validation text never shapes the vocabulary), or on a
    deterministic sample of them (path hash order) when the preset caps its bytes."""
    p = ctx.preset
    bpe_texts = [f.text for f in train_files]
    if p.bpe_sample_bytes is not None:
        bpe_texts, room = [], p.bpe_sample_bytes
        for f in sorted(train_files, key=lambda f: corpus.path_bucket(f.rel, "bpe")):
            if room <= 0:
                break
            bpe_texts.append(f.text)
            room -= len(f.text)
    t1 = time.time()
    tok = tk.train_bpe(bpe_texts, p.vocab_size)
    ctx.log(f"[tokenizer] BPE on {sum(len(t) for t in bpe_texts)} characters in {time.time() - t1:.1f} s")
    return tok, {"bpe_bytes": sum(len(t.encode("utf-8")) for t in bpe_texts)}


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
    if ctx.family_dir is not None:
        return copy_target(ctx)
    return pretrain(ctx, "target", ctx.preset.target, ctx.preset.target_sched, seed_offset=1)


def copy_target(ctx: Context) -> dict:
    """The family's target as this stage's checkpoint (fp32, as pre-training leaves it; the shipped fp16
    weights convert exactly), measured on this run's validation windows."""
    t0, src = time.time(), ctx.family_dir / "target"
    model = lm.load_lm(src, ctx.device).eval()
    model.save_pretrained(str(ctx.stage_dir("target") / "model"), safe_serialization=True)
    n_params = lm.count_params(model)
    metrics = dict(params=n_params, fp16_bytes=2 * n_params, from_family=str(ctx.family_dir),
                   **lm.eval_lm(model, ctx.val_windows(), ctx.device))
    ctx.log(f"[target] copied from {src}: {n_params:,} params, val loss {metrics['val_loss']:.4f}")
    return finish(ctx, "target", metrics, t0)


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


def stage_selfgen(ctx: Context) -> dict:
    """The target's own text for the heads: continuations of random training windows (a share greedy, the
    rest sampled), and greedy continuations of validation windows (held out: the Medusa tree's path
    accuracies and the EAGLE-3 figures are measured on them). The training text stops early at the time
    budget, which starts once the held-out text is made."""
    from engine.train.generate import generate

    t0, p, sg = time.time(), ctx.preset, ctx.preset.selfgen
    d = ctx.stage_dir("selfgen")
    d.mkdir(parents=True, exist_ok=True)
    lm.seed_all(p.seed + 6)
    target = load_target(ctx)
    width = ctx.head_len + 1
    new = width - sg.prompt_len
    gen = torch.Generator(device=ctx.device).manual_seed(p.seed + 6)
    # held-out greedy text first (small), then training text until the count or the time budget
    starts = torch.linspace(0, max(0, len(ctx.data.val) - sg.prompt_len - 1), sg.val_sequences).long()
    offsets = torch.arange(sg.prompt_len, device=ctx.device)
    val_prompts = ctx.data.val[starts.to(ctx.device)[:, None] + offsets]
    val_rows = []
    for chunk in lm.chunks(val_prompts, sg.batch_size):
        val_rows.append(torch.cat([chunk, generate(target, chunk, None, new)], 1).cpu())
    rows, greedy_rows = [], 0
    started = time.time()  # the budget is the training text's: the held-out text above is always made
    while sum(len(r) for r in rows) < sg.sequences and time.time() - started < sg.time_budget_s:
        prompts = ctx.data.batch(sg.batch_size, sg.prompt_len - 1)          # [B, prompt_len]
        done = sum(len(r) for r in rows)
        greedy = greedy_rows < sg.greedy_fraction * (done + len(prompts))   # keeps the greedy share
        temperature = 0.0 if greedy else sg.temperature
        rows.append(torch.cat([prompts, generate(target, prompts, None, new, temperature, gen)], 1).cpu())
        greedy_rows += len(prompts) if greedy else 0
    train = torch.cat(rows).numpy().astype(np.uint16) if rows else np.zeros((0, width), np.uint16)
    val = torch.cat(val_rows).numpy().astype(np.uint16)
    np.save(d / "train.npy", train)
    np.save(d / "val.npy", val)
    metrics = {"train_sequences": int(len(train)), "greedy_sequences": int(greedy_rows),
               "val_sequences": int(len(val)), "width": width, "prompt_len": sg.prompt_len,
               "temperature": sg.temperature, "train_tokens": int(train.size),
               "eos_share": float((train == lm.EOS_ID).mean()) if train.size else 0.0,
               "gen_tokens_per_s": round(train.size / max(1e-9, time.time() - t0))}
    ctx.log(f"[selfgen] {len(train)} sequences ({greedy_rows} greedy) + {len(val)} held-out, width {width}")
    return finish(ctx, "selfgen", metrics, t0)


def stage_medusa(ctx: Context) -> dict:
    """Medusa heads on the frozen target. With the preset's medusa_greedy (the shipped recipe): trained on the
    target's greedy text, the snapshot, the figures and the drafter's tree (path accuracies) taken from
    held-out greedy text (see MedusaGreedy). Else self-distilled on its distributions (Medusa-2 style) over
    corpus windows and its own text, the tree from held-out greedy text of the target when the selfgen stage
    made it, else from validation windows."""
    if ctx.preset.medusa_greedy is not None:
        return stage_medusa_greedy(ctx)
    t0, p, sched = time.time(), ctx.preset, ctx.preset.medusa_sched
    lm.seed_all(p.seed + 4)
    target = load_target(ctx)
    H = target.config.hidden_size
    mh = heads.MedusaHeads(H, p.medusa_heads, p.medusa_layers).to(ctx.device).train()
    sets = ctx.head_eval_sets()
    loss = heads.medusa_distill_loss if p.medusa_distill else heads.medusa_loss
    res = lm.run_schedule(
        mh, list(mh.parameters()), sched,
        loss_fn=lambda step: loss(mh, target, ctx.head_batch(sched.batch_size)),
        eval_fn=lambda: _drop_paths(heads.eval_medusa(mh, target, sets["corpus"], ctx.device)),
        device=ctx.device, log=ctx.log, key="mean_loss")
    final = heads.eval_medusa(mh, target, sets["corpus"], ctx.device)
    calibration = "corpus"
    measured = final
    if "generated" in sets:
        measured = heads.eval_medusa(mh, target, sets["generated"], ctx.device)
        calibration = "generated"
    heads.save_medusa(mh, H, ctx.stage_dir("medusa"), dtype=torch.float32,
                      path_accuracy=measured["path_accuracy"])
    metrics = dict(schedule_summary(res, sched.batch_size * ctx.head_len), final=final,
                   final_generated=_drop_paths(dict(measured)) if calibration == "generated" else None,
                   tree_calibrated_on=calibration, params=lm.count_params(mh),
                   loss="self-distillation" if p.medusa_distill else "corpus cross-entropy")
    return finish(ctx, "medusa", metrics, t0)


def stage_medusa_greedy(ctx: Context) -> dict:
    """The medusa stage with the preset's medusa_greedy recipe: greedy text made (or read back), features
    computed once, then positions of it sampled at random for each step (no target forward per step)."""
    t0, p, sched, g = time.time(), ctx.preset, ctx.preset.medusa_sched, ctx.preset.medusa_greedy
    lm.seed_all(p.seed + 4)
    target = load_target(ctx)
    H = target.config.hidden_size
    mh = heads.MedusaHeads(H, p.medusa_heads, p.medusa_layers).to(ctx.device).train()
    train_rows, made_s = medusa_greedy_text(ctx, target, "train")
    val_rows, _ = medusa_greedy_text(ctx, target, "val")
    train_top, top_s = top_level_greedy_text(ctx, target, "train")
    val_top, _ = top_level_greedy_text(ctx, target, "val")
    made_s += top_s
    t1 = time.time()
    texts = [(row, g.prompt_len) for row in train_rows] + train_top
    val_texts = [(row, g.prompt_len) for row in val_rows] + val_top
    x, labels = heads.greedy_examples_of(target, texts, p.medusa_heads)   # [M, H], [M, D]
    val_x, val_labels = heads.greedy_examples_of(target, val_texts, p.medusa_heads)
    ctx.log(f"[medusa] greedy text: {len(train_rows)} + {len(train_top)} continuations, {len(x)} positions; "
            f"held out {len(val_rows)} + {len(val_top)}, {len(val_x)} positions (text {made_s:.0f} s, "
            f"features {time.time() - t1:.0f} s)")
    pick = torch.Generator().manual_seed(p.seed + 4)

    def loss_fn(step: int) -> torch.Tensor:
        idx = torch.randint(0, len(x), (sched.batch_size,), generator=pick).to(x.device)
        return heads.medusa_greedy_loss(mh, target, x[idx], labels[idx])

    res = lm.run_schedule(
        mh, list(mh.parameters()), sched, loss_fn=loss_fn,
        eval_fn=lambda: _drop_paths(heads.eval_medusa_greedy(mh, target, val_x, val_labels)),
        device=ctx.device, log=ctx.log, key="mean_loss")
    measured = heads.eval_medusa_greedy(mh, target, val_x, val_labels)
    heads.save_medusa(mh, H, ctx.stage_dir("medusa"), dtype=torch.float32,
                      path_accuracy=measured["path_accuracy"])
    top_level = None
    if val_top:  # the held-out continuations of prompts of the held-out prompts' form alone
        top_x, top_labels = heads.greedy_examples_of(target, val_top, p.medusa_heads)
        top_level = _drop_paths(heads.eval_medusa_greedy(mh, target, top_x, top_labels))
    final = heads.eval_medusa(mh, target, ctx.head_val_windows(), ctx.device)  # corpus text, for comparison
    metrics = dict(schedule_summary(res, sched.batch_size), final=_drop_paths(final),
                   final_generated=_drop_paths(dict(measured)), final_top_level=top_level,
                   tree_calibrated_on="generated", params=lm.count_params(mh), layers=p.medusa_layers,
                   loss="cross-entropy against the target's greedy text",
                   greedy_text={"sequences": len(train_rows), "positions": len(x),
                                "val_sequences": len(val_rows), "val_positions": len(val_x),
                                "top_level_sequences": len(train_top),
                                "top_level_val_sequences": len(val_top),
                                "prompt_len": g.prompt_len, "new_tokens": g.new_tokens,
                                "text_s": round(made_s, 1)})
    return finish(ctx, "medusa", metrics, t0)


def medusa_greedy_text(ctx: Context, target, split: str) -> tuple:
    """[N, prompt_len + new_tokens]: the target's greedy continuations of medusa_prompts' windows ("train" or
    the held-out "val"), made once and kept in the stage's folder (a resumed run reads them back);
    continuations that reach EOS are left out (decoding stops there). Returns the rows and the seconds spent
    making them (0 when read back)."""
    from engine.train.generate import generate

    g = ctx.preset.medusa_greedy
    d = ctx.stage_dir("medusa")
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"greedy_{split}.npy"
    if path.exists():
        return torch.from_numpy(np.load(path).astype(np.int64)).to(ctx.device), 0.0
    t0, parts = time.time(), []
    count = g.val_sequences if split == "val" else g.sequences
    prompts = medusa_prompts(ctx, split, count).to(ctx.device)                        # [N, prompt_len]
    for chunk in lm.chunks(prompts, g.batch_size):
        parts.append(torch.cat([chunk, generate(target, chunk, None, g.new_tokens)], 1).cpu())
    rows = torch.cat(parts)
    ended = (rows[:, g.prompt_len:] == lm.EOS_ID).any(1)
    rows = rows[~ended]
    ctx.log(f"[medusa] {split} greedy text: {int(ended.sum())} of {len(ended)} continuations reached EOS, "
            f"left out")
    np.save(path, rows.numpy().astype(np.uint16))
    return rows.to(ctx.device), time.time() - t0


def top_level_greedy_text(ctx: Context, target, split: str) -> tuple:
    """The target's greedy continuations of top_level_prompts ("train" or the held-out "val"), each
    (ids [P + new_tokens], P), made once and kept in the stage's folder; continuations that reach EOS are left
    out. Returns them and the seconds spent making them (0 when read back or when the recipe has none)."""
    from engine.train.generate import generate, left_pad

    g = ctx.preset.medusa_greedy
    if not g.top_level_rounds:
        return [], 0.0
    path = ctx.stage_dir("medusa") / f"greedy_top_{split}.npz"
    if path.exists():
        return read_top_level_text(path, g.new_tokens, ctx.device), 0.0
    t0, texts = time.time(), []
    prompts = sorted(top_level_prompts(ctx, split), key=len)  # alike lengths share a batch: little padding
    for start in range(0, len(prompts), g.batch_size):
        chunk = prompts[start:start + g.batch_size]
        ids, mask = left_pad(chunk)
        new = generate(target, ids.to(ctx.device), mask.to(ctx.device), g.new_tokens).cpu()  # [B, N]
        texts += [(torch.cat([torch.tensor(p), n]), len(p)) for p, n in zip(chunk, new)
                  if not (n == lm.EOS_ID).any()]
    ctx.log(f"[medusa] {split} top-level greedy text: {len(prompts) - len(texts)} of {len(prompts)} "
            f"continuations reached EOS, left out")
    np.savez(path, tokens=torch.cat([t for t, _ in texts]).numpy().astype(np.uint16),
             prompt_lens=np.array([n for _, n in texts], dtype=np.int32))
    return [(t.to(ctx.device), n) for t, n in texts], time.time() - t0


def read_top_level_text(path: Path, new_tokens: int, device) -> list:
    """top_level_greedy_text's saved continuations (tokens end to end, each text's prompt length) as
    [(ids [P + new_tokens], P)]."""
    saved = np.load(path)
    lengths = saved["prompt_lens"].astype(np.int64)
    ends = np.cumsum(lengths + new_tokens)
    tokens = torch.from_numpy(saved["tokens"].astype(np.int64)).to(device)
    return [(tokens[end - n - new_tokens:end], int(n)) for end, n in zip(ends, lengths)]


def top_level_prompts(ctx: Context, split: str) -> list:
    """Token lists in the held-out prompts' form (corpus.heldout_prompts: whole lines from a top-level line
    in the middle 70% of a file, 100 to 300 characters), drawn from the same standard-library training files
    as medusa_prompts ("val": the held-out tenth): top_level_rounds passes, each from its own place in every
    file, ending at 300, 220 or 160 characters ("val": 300, a fifth as many passes); no prompt twice."""
    g = ctx.preset.medusa_greedy
    tok = Tokenizer.from_file(str(ctx.stage_dir("tokenizer") / "tokenizer" / "tokenizer.json"))
    rounds, ends = ((max(1, g.top_level_rounds // 5), (300,)) if split == "val"
                    else (g.top_level_rounds, (300, 220, 160)))
    seen, prompts = set(), []
    for round_ in range(rounds):
        for f in medusa_files(ctx, split):
            place = 0.15 + 0.7 * corpus.path_bucket(f.rel, f"medusa_prompt{round_}")
            start = corpus.prompt_start(f.text, place)
            for hi in ends:
                text = corpus.cut_prompt(f.text, start, 100, hi)
                if text and text not in seen:
                    seen.add(text)
                    prompts.append(tok.encode(text).ids)
    return prompts[:g.top_level_limit] if g.top_level_limit else prompts


def medusa_files(ctx: Context, split: str) -> list:
    """The standard-library training files the Medusa recipe's prompts come from: outside the corpus's
    validation split and the test suite, the held-out tenth (by path hash) for "val" only."""
    files = [f for f in corpus.load_stdlib(ctx.preset.max_file_bytes) if not corpus.in_test_suite(f.rel)]
    splits = corpus.assign_splits([f.rel for f in files], ctx.preset.val_fraction)
    held = [corpus.path_bucket(f.rel, "medusa") < 0.1 for f in files]
    pool = [f for f, h in zip(files, held) if splits[f.rel] == "train" and h == (split == "val")]
    if not pool:
        raise SpecplayError(f"no standard-library training files for the Medusa {split} prompts")
    return pool


def medusa_prompts(ctx: Context, split: str, count: int) -> torch.Tensor:
    """[count, prompt_len]: the prompt_len tokens before a line end in the middle 70% of a standard-library
    training file, the files and line ends drawn at random (seeded). The files of the corpus's validation
    split are never read (the held-out prompts `bench` decodes come from them); a tenth of the training files
    (by path hash) serve the "val" split only, the rest "train"; the stdlib test suite is left out (the
    target's greedy continuations of its repetitive tests loop: docs/measurements/
    cpu_medusa_greedy_stdlib_windows.txt)."""
    g, p = ctx.preset.medusa_greedy, ctx.preset
    tok = Tokenizer.from_file(str(ctx.stage_dir("tokenizer") / "tokenizer" / "tokenizer.json"))
    pool = medusa_files(ctx, split)
    rng = np.random.default_rng(p.seed + (7 if split == "val" else 5))
    rows: list = []
    for _ in range(50 * count):
        if len(rows) == count:
            break
        text = pool[rng.integers(len(pool))].text
        end = text.find("\n", int(len(text) * rng.uniform(0.15, 0.85))) + 1   # just after a line end
        if end <= 0:
            continue
        ids = tok.encode(text[max(0, end - 40 * g.prompt_len):end], add_special_tokens=False).ids
        if len(ids) > g.prompt_len:  # the first token may be a cut one: never kept
            rows.append(ids[-g.prompt_len:])
    if len(rows) < count:
        raise SpecplayError(f"only {len(rows)} of {count} Medusa {split} prompts found in the standard "
                            "library")
    return torch.tensor(rows, dtype=torch.long)


def _drop_paths(ev: dict) -> dict:
    ev.pop("path_accuracy", None)
    return ev


def stage_eagle(ctx: Context) -> dict:
    t0, p, sched = time.time(), ctx.preset, ctx.preset.eagle_sched
    lm.seed_all(p.seed + 5)
    target = load_target(ctx)
    head = heads.EagleHead(heads.eagle_llama_config(target.config)).to(ctx.device).train()
    val = ctx.head_val_windows()
    w_ce = p.eagle_ce_weight

    def eval_fn() -> dict:
        return {"eagle_loss": heads.eval_eagle_loss(head, target, val, ctx.device, w_ce),
                **heads.eval_eagle(head, target, val, ctx.device)}

    res = lm.run_schedule(
        head, list(head.parameters()), sched,
        loss_fn=lambda step: heads.eagle_loss(head, target, ctx.head_batch(sched.batch_size), w_ce),
        eval_fn=eval_fn, device=ctx.device, log=ctx.log, key="eagle_loss")
    heads.save_eagle(head, ctx.stage_dir("eagle"), dtype=torch.float32)
    metrics = dict(schedule_summary(res, sched.batch_size * ctx.head_len), final=eval_fn(),
                   params=lm.count_params(head), ce_weight=w_ce)
    return finish(ctx, "eagle", metrics, t0)


def stage_eagle3(ctx: Context) -> dict:
    """The EAGLE-3 head: tap-layer features, training-time test, self-distillation (see
    engine/train/eagle3.py)."""
    from engine.train import eagle3

    t0, p, sched = time.time(), ctx.preset, ctx.preset.eagle3_sched
    lm.seed_all(p.seed + 7)
    target = load_target(ctx)
    layers = target.config.num_hidden_layers
    if p.eagle3_arch == "published":
        taps = tuple(p.eagle3_taps) if p.eagle3_taps else eagle3.published_taps(layers)
        head = eagle3.PublishedEagle3Head.for_target(target, taps, p.eagle3_intermediate)
    else:
        taps = tuple(p.eagle3_taps) if p.eagle3_taps else eagle3.default_taps(layers)
        head = eagle3.Eagle3Head.for_target(target.config, taps, p.eagle3_intermediate)
    head = head.to(ctx.device).train()
    sets = ctx.head_eval_sets()
    steps, decay = p.eagle3_steps, p.eagle3_decay

    def eval_fn() -> dict:
        return eagle3.eval_eagle3(head, target, sets["corpus"], ctx.device, steps, decay)

    res = lm.run_schedule(
        head, list(head.parameters()), sched,
        loss_fn=lambda step: eagle3.eagle3_loss(head, target, ctx.head_batch(sched.batch_size), steps, decay),
        eval_fn=eval_fn, device=ctx.device, log=ctx.log, key="eagle3_loss")
    if p.eagle3_arch == "published":
        eagle3.save_published(head, ctx.stage_dir("eagle3"), dtype=torch.float32)
    else:
        eagle3.save_eagle3(head, ctx.stage_dir("eagle3"), dtype=torch.float32)
    generated = None
    if "generated" in sets:
        generated = eagle3.eval_eagle3(head, target, sets["generated"], ctx.device, steps, decay)
        ctx.log("[eagle3] on the target's held-out greedy text: " + "  ".join(
            f"chain{s} {generated[f'chain{s}_top1']:.3f}" for s in range(1, steps + 1)))
    metrics = dict(schedule_summary(res, sched.batch_size * ctx.head_len), final=eval_fn(),
                   final_generated=generated, params=lm.count_params(head), tap_layers=list(taps),
                   steps=steps, decay=decay, intermediate_size=p.eagle3_intermediate, arch=p.eagle3_arch)
    return finish(ctx, "eagle3", metrics, t0)


def stage_export(ctx: Context) -> dict:
    from engine.train import export

    t0 = time.time()
    finished = {s: load_metrics(ctx, s) for s in STAGES if s not in ("export", "eval")
                and (ctx.stage_dir(s) / "metrics.json").exists()}
    report = export.export_all(ctx, finished)
    return finish(ctx, "export", {"export_dir": str(ctx.export_dir), "files": report["files"]}, t0)


def stage_eval(ctx: Context) -> dict:
    """Plausibility and held-out stdlib perplexity of the exported family (and of ctx.baseline_dir, e.g. the
    shipped one, for a before/after); the results go into the export's report and model card."""
    from engine.train import export, plausibility

    t0, p = time.time(), ctx.preset
    kwargs = dict(device=ctx.device, limit=p.eval_signatures, max_files=p.eval_max_files,
                  new_tokens=p.eval_new_tokens, log=ctx.log)
    results = {"new": plausibility.evaluate_family(ctx.export_dir, **kwargs)}
    if ctx.baseline_dir is not None and (Path(ctx.baseline_dir) / "target" / "config.json").exists():
        results["baseline"] = plausibility.evaluate_family(Path(ctx.baseline_dir), **kwargs)
    export.add_evaluation(ctx.export_dir, results)
    return finish(ctx, "eval", results, t0)


RUNNERS = {"tokenizer": stage_tokenizer, "target": stage_target, "draft": stage_draft,
           "distill": stage_distill, "selfgen": stage_selfgen, "medusa": stage_medusa, "eagle": stage_eagle,
           "eagle3": stage_eagle3, "export": stage_export, "eval": stage_eval}
ALWAYS_RUN = ("export", "eval")


def run_stages(ctx: Context, stages: list[str]) -> None:
    """Run the requested stages in pipeline order, skipping finished ones (export and eval always re-run)."""
    if ctx.family_dir is not None:
        check_family(ctx)
    for stage in STAGES:
        if stage not in stages:
            continue
        if stage not in ALWAYS_RUN and is_done(ctx, stage):
            ctx.log(f"[{stage}] checkpoint found in {ctx.stage_dir(stage)}: skipped")
            continue
        ctx.log(f"[{stage}] start")
        m = RUNNERS[stage](ctx)
        ctx.log(f"[{stage}] done in {m['wall_s']} s")
