"""Export the trained family to the shipped layout (HF format, fp16) and write the model card.

Layout of the export directory:
  target/  config.json model.safetensors generation_config.json tokenizer files,
           medusa_heads.safetensors medusa_config.json eagle_head.safetensors eagle_config.json
           eagle3_head.safetensors eagle3_config.json (the project's EAGLE-3 architecture), or with
           --eagle3-arch published eagle3/ (config.json model.safetensors, the speculators layout)
  draft/   config.json model.safetensors generation_config.json tokenizer files
  manifest.json heldout_prompts.json heldout_sample.txt train_report.json README.md
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from engine.errors import SpecplayError
from engine.train import heads, lm

TARGET_MAX_BYTES = 15_000_000
DRAFT_MAX_BYTES = 4_000_000
# the shipped family in all: 26 MB until its EAGLE-3 head took the published architecture, which carries its
# own norm and LM head (4,096 draft tokens: 2.6 MB of it; the project's head read the target's)
SHIPPED_MAX_BYTES = 29_000_000
ALPHA_SECTION = "## Speculative decoding measured with specplay"
PIPELINE_FILES = ("done.json", "metrics.json")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def export_lm(src: Path, tok_dir: Path, dst: Path) -> None:
    """Copy one fp32 checkpoint to `dst` as fp16 safetensors plus tokenizer and generation config."""
    from transformers import GenerationConfig, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(src), dtype=torch.float32).to(torch.float16)
    model.generation_config = GenerationConfig(bos_token_id=lm.BOS_ID, eos_token_id=lm.EOS_ID,
                                               pad_token_id=lm.PAD_ID)
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(dst), safe_serialization=True)
    for f in tok_dir.iterdir():
        shutil.copy2(f, dst / f.name)


@torch.no_grad()
def text_loss(model, tokenizer, text: str, window: int, device) -> tuple[float, int]:
    """Mean next-token loss (nats) of `<s> text` in non-overlapping windows; returns (loss, n_tokens)."""
    ids = torch.tensor(tokenizer(text, verbose=False)["input_ids"], device=device)   # [N], starts with <s>
    total, count = 0.0, 0
    for i in range(0, len(ids) - 1, window):
        w = ids[i: i + window + 1][None]                                 # [1, <=window+1]
        if w.shape[1] < 2:
            break
        logits = model(input_ids=w[:, :-1], use_cache=False).logits.float()
        total += torch.nn.functional.cross_entropy(logits[0], w[0, 1:], reduction="sum").item()
        count += w.shape[1] - 1
    return total / count, count


def self_unigram_loss(tokenizer, text: str) -> float:
    """Entropy of the text's own token unigram distribution: the best any unigram model can do on it."""
    ids = np.asarray(tokenizer(text, verbose=False)["input_ids"][1:])
    p = np.bincount(ids) / len(ids)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def heldout_sample_losses(models_dir: Path, device="cpu") -> dict:
    """Losses on heldout_sample.txt of the exported target and draft, and the unigram baseline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text = (models_dir / "heldout_sample.txt").read_bytes().decode("utf-8")
    tok = AutoTokenizer.from_pretrained(str(models_dir / "target"))
    out = {"unigram_self_entropy": self_unigram_loss(tok, text)}
    for name in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(str(models_dir / name), dtype=torch.float32).to(device)
        window = min(512, model.config.max_position_embeddings)
        out[name], out["n_tokens"] = text_loss(model.eval(), tok, text, window, device)
    return out


def export_medusa_heads(ctx, dst: Path) -> None:
    """The Medusa heads in fp16 (their matrices in int8 with the preset's medusa_int8), with the path
    accuracies measured by the medusa stage."""
    mh = heads.load_medusa(ctx.stage_dir("medusa"))
    path_accuracy = heads.medusa_path_accuracy(ctx.stage_dir("medusa"))
    heads.save_medusa(mh, mh.heads[0].in_features, dst, dtype=torch.float16, path_accuracy=path_accuracy,
                      int8=ctx.preset.medusa_int8)


def export_heads(ctx, dst: Path) -> None:
    """Medusa and EAGLE heads beside the target, in fp16."""
    export_medusa_heads(ctx, dst)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(ctx.stage_dir("target") / "model"))
    heads.save_eagle(heads.load_eagle(ctx.stage_dir("eagle"), cfg), dst, dtype=torch.float16)


def export_eagle3(ctx, dst: Path) -> None:
    """The project's head into dst (eagle3_head.safetensors, eagle3_config.json), or a published-architecture
    one (preset eagle3_arch) in the speculators layout (config.json, model.safetensors)."""
    from engine.train import eagle3

    if ctx.preset.eagle3_arch == "published":
        eagle3.save_published(eagle3.load_published(ctx.stage_dir("eagle3")), dst, dtype=torch.float16)
        if ctx.preset.eagle3_draft_vocab:
            reduce_draft_vocab(ctx, dst, ctx.preset.eagle3_draft_vocab)
        return
    eagle3.save_eagle3(eagle3.load_eagle3(ctx.stage_dir("eagle3")), dst, dtype=torch.float16)


def reduce_draft_vocab(ctx, head_dir: Path, size: int) -> None:
    """Cut a published EAGLE-3 head's LM head (in head_dir) to the `size` tokens most frequent in the training
    split (the tokenizer stage's train.npy), the target's special tokens among them."""
    from engine.train import draft_vocab

    config = json.loads((ctx.stage_dir("target") / "model" / "config.json").read_text())
    counts = np.bincount(np.load(ctx.stage_dir("tokenizer") / "train.npy").astype(np.int64),
                         minlength=config["vocab_size"])
    keep = draft_vocab.choose_ids(counts, size, draft_vocab.special_ids(config))
    coverage = float(counts[keep.numpy()].sum() / max(1, counts.sum()))
    draft_vocab.reduce_head(head_dir, head_dir, keep, coverage)
    ctx.log(f"[export] EAGLE-3 draft vocabulary: {size} of {config['vocab_size']} tokens, {coverage:.4f} of "
            "the training split's")


def collect_report(ctx, sample_losses: dict, stages: dict) -> dict:
    """stages: each finished stage's metrics (the caller, engine.train.stages, reads them); the evaluation
    histories stay in the run directory (<out>/<stage>/metrics.json), so the shipped report stays small."""
    stages = {name: {k: v for k, v in m.items() if k != "history"} for name, m in stages.items()}
    return {"preset": ctx.preset.to_dict(), "stages": stages, "heldout_sample_losses": sample_losses,
            "exported": time.strftime("%Y-%m-%d %H:%M:%S")}


def file_table(root: Path) -> list[dict]:
    rows = []
    for f in sorted(root.rglob("*")):
        if f.parent == root and f.name in PIPELINE_FILES:   # the export stage's own markers, not shipped
            continue
        if f.is_file() and f.name != "README.md":
            rows.append({"path": f.relative_to(root).as_posix(), "bytes": f.stat().st_size,
                         "sha256": sha256_file(f)})
    return rows


def export_all(ctx, stage_metrics: dict) -> dict:
    dst = ctx.export_dir
    dst.mkdir(parents=True, exist_ok=True)
    data = ctx.stage_dir("tokenizer")
    tok_dir = data / "tokenizer"
    export_lm(ctx.stage_dir("target") / "model", tok_dir, dst / "target")
    draft_src = ctx.stage_dir("distill") if (ctx.stage_dir("distill") / "done.json").exists() \
        else ctx.stage_dir("draft")
    export_lm(draft_src / "model", tok_dir, dst / "draft")
    if (ctx.stage_dir("medusa") / "done.json").exists() and (ctx.stage_dir("eagle") / "done.json").exists():
        export_heads(ctx, dst / "target")
    if (ctx.stage_dir("eagle3") / "done.json").exists():
        export_eagle3(ctx, dst / "target" / ("eagle3" if ctx.preset.eagle3_arch == "published" else ""))
    for name in ("manifest.json", "heldout_prompts.json", "heldout_sample.txt"):
        shutil.copy2(data / name, dst / name)
    losses = heldout_sample_losses(dst, ctx.device)
    report = collect_report(ctx, losses, stage_metrics)
    report["draft_source"] = draft_src.name
    (dst / "train_report.json").write_text(json.dumps(report, indent=1))
    files = file_table(dst)
    report["files"] = files
    (dst / "README.md").write_text(model_card(report, files))
    check_sizes(dst, files, ctx.log)
    ctx.log(f"[export] {len(files)} files, {sum(r['bytes'] for r in files) / 1e6:.2f} MB -> {dst}; "
            f"held-out sample loss target {losses['target']:.3f} draft {losses['draft']:.3f} "
            f"unigram {losses['unigram_self_entropy']:.3f}")
    return report


def export_medusa_only(ctx, dst: Path) -> dict:
    """Only the Medusa heads (medusa_heads.safetensors, medusa_config.json: to copy over the family's
    target/) and medusa_report.json (the schedule and the metrics of the stages they came from)."""
    greedy = ctx.preset.medusa_greedy
    return _export_head_only(ctx, dst, "medusa", lambda: export_medusa_heads(ctx, dst),
                             {"medusa_heads": ctx.preset.medusa_heads,
                              "medusa_greedy": None if greedy is None else asdict(greedy)},
                             "medusa_heads.safetensors, medusa_config.json")


def export_eagle3_only(ctx, dst: Path) -> dict:
    """Only the EAGLE-3 head (published: config.json, model.safetensors, for the family's target/eagle3/;
    the project's: eagle3_head.safetensors, eagle3_config.json, to copy over its target/) and
    eagle3_report.json, as export_medusa_only does for the Medusa heads."""
    p = ctx.preset
    files = ("config.json, model.safetensors" if p.eagle3_arch == "published"
             else "eagle3_head.safetensors, eagle3_config.json")
    return _export_head_only(ctx, dst, "eagle3", lambda: export_eagle3(ctx, dst),
                             {"eagle3_steps": p.eagle3_steps, "eagle3_decay": p.eagle3_decay,
                              "eagle3_arch": p.eagle3_arch, "eagle3_draft_vocab": p.eagle3_draft_vocab},
                             files)


def _export_head_only(ctx, dst: Path, stage: str, write, extra: dict, files: str) -> dict:
    """A head stage's files (write()) and <stage>_report.json: the stage's schedule and the metrics of the
    target, selfgen and head stages it came from."""
    if not (ctx.stage_dir(stage) / "done.json").exists():
        raise SpecplayError(f"{ctx.stage_dir(stage)}: the {stage} stage has not finished")
    dst.mkdir(parents=True, exist_ok=True)
    write()
    stages = {}
    for name in ("target", "selfgen", stage):
        if (ctx.stage_dir(name) / "done.json").exists():
            stages[name] = json.loads((ctx.stage_dir(name) / "metrics.json").read_text())
    stages.get("target", {}).pop("history", None)   # the head's learning curve stays: it is small
    p = ctx.preset
    report = {"preset": p.name, "from_family": None if ctx.family_dir is None else str(ctx.family_dir),
              f"{stage}_sched": asdict(getattr(p, f"{stage}_sched")), **extra,
              "head_seq_len": ctx.head_len, "gen_fraction": p.gen_fraction, "stages": stages,
              "exported": time.strftime("%Y-%m-%d %H:%M:%S")}
    (dst / f"{stage}_report.json").write_text(json.dumps(report, indent=1))
    ctx.log(f"[export-{stage}] {files}, {stage}_report.json -> {dst}")
    return report


def add_evaluation(dst: Path, results: dict) -> None:
    """Record the eval stage's results (plausibility, held-out perplexity; the new family and a baseline) in
    the export's train_report.json and rewrite its model card."""
    report_path = dst / "train_report.json"
    report = json.loads(report_path.read_text())
    report["evaluation"] = {k: {key: v for key, v in r.items() if key != "examples"}
                            for k, r in results.items()}
    report["evaluation_examples"] = results.get("new", {}).get("examples", [])[:3]
    report_path.write_text(json.dumps(report, indent=1))
    card_path = dst / "README.md"
    alpha = alpha_section(card_path.read_text()) if card_path.exists() else None
    card_path.write_text(model_card(report, file_table(dst), alpha))


def check_sizes(dst: Path, files: list[dict], log) -> None:
    sizes = {r["path"]: r["bytes"] for r in files}
    caps = (("target/model.safetensors", TARGET_MAX_BYTES), ("draft/model.safetensors", DRAFT_MAX_BYTES))
    for path, cap in caps:
        if sizes.get(path, 0) > cap:
            log(f"[export] WARNING {path} is {sizes[path]} bytes > {cap}")
    total = sum(sizes.values()) + (dst / "README.md").stat().st_size
    if total > SHIPPED_MAX_BYTES:
        log(f"[export] WARNING shipped total {total} bytes > {SHIPPED_MAX_BYTES}")


# ----------------------------------------------------------------------------- model card

def fmt(x, nd: int = 4) -> str:
    return "n/a" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def shape_line(cfg: dict) -> str:
    return (f"hidden {cfg['hidden_size']}, {cfg['num_layers']} layers, {cfg['num_heads']} heads "
            f"({cfg['num_kv_heads']} KV), MLP {cfg['intermediate_size']}")


def sched_line(s: dict) -> str:
    return (f"{s['steps']} steps max, batch {s['batch_size']}, peak lr {s['lr']}, "
            f"wall cap {s['time_budget_s']} s, "
            f"warm-up {s['warmup_steps']}, weight decay {s['weight_decay']}")


def stage_time_rows(st: dict) -> list[str]:
    rows = ["| stage | wall time (s) | optimiser steps | kept snapshot (step) | tokens/s | capped by time "
            "| hardware |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, m in st.items():
        best = (m.get("best") or {}).get("step", "-")
        rows.append(f"| {name} | {m.get('wall_s')} | {m.get('steps_done', '-')} | {best} | "
                    f"{m.get('tokens_per_s', '-')} | {m.get('stopped_by_time', '-')} | {m.get('hardware')} |")
    return rows


def data_lines(p: dict, tokm: dict) -> list[str]:
    """The Data section: the stdlib-only corpus as before, or the sources, licences and skipped packages."""
    if tokm.get("corpus", "stdlib") == "stdlib":
        return [
            f"- Corpus: the `.py` files of the Python {tokm.get('python_version')} standard "
            f"library of the training machine's interpreter (site-packages skipped, test suites kept, files "
            f"over {p['max_file_bytes']} bytes skipped), read as UTF-8 with errors replaced. `manifest.json` "
            f"lists every file with its sha256."]
    sources = tokm.get("sources", [])
    L = [
        f"- Corpus: the `.py` files of the Python {tokm.get('python_version')} standard library of the "
        "training machine's interpreter, and of its installed distributions whose metadata names a "
        "permissive licence (License-Expression, else the licence classifiers, else the License field; "
        "unknown, proprietary and copyleft ones skipped), read as UTF-8 with errors replaced. At most "
        f"{p.get('max_package_bytes')} bytes per distribution (a fixed subset by path hash beyond it). Files "
        f"over {p['max_file_bytes']} bytes, near-empty files (under 4 code lines), generated files (a "
        "`DO NOT EDIT`-style header, data-table line lengths) and exact duplicates (content sha256; the "
        f"standard library first) were dropped: {tokm.get('dropped_files')}.",
        "- `manifest.json` lists the validation files with their sha256, the packages and their licences, "
        "and the skipped packages; its corpus sha256 covers every file (paths and texts, in order).",
        "", "| source | files | validation files | bytes | tokens |", "| --- | --- | --- | --- | --- |"]
    L += [f"| {r['source']} | {r['files']} | {r['val_files']} | {r['bytes']} | {r.get('tokens', '-')} |"
          for r in sources]
    pk = tokm.get("packages") or []
    licences: dict = {}
    for row in pk:
        licences.setdefault(row["licence"], []).append(row["name"])
    L += ["", "Licences of the included packages: " + "; ".join(
        f"{lic}: {', '.join(sorted(names))}" for lic, names in sorted(licences.items())) + ".", ""]
    skipped = tokm.get("skipped_packages") or []
    L.append("Skipped packages: " + ("; ".join(f"{r['name']} {r['version']} ({r['reason']})" for r in skipped)
                                     or "none") + ".")
    return L


def evaluation_lines(report: dict) -> list[str]:
    ev = report.get("evaluation")
    if not ev:
        return []
    new, base = ev.get("new", {}), ev.get("baseline")
    L = ["## Held-out evaluation (before / after)",
         f"Plausibility: the share of greedy completions of {new.get('n_signatures')} held-out function "
         "signatures (standard-library validation files, the split both families share; "
         f"{new.get('new_tokens')} new tokens) that `ast.parse` accepts; the function is cut where it ends, "
         "else at its last complete logical line (the exact rule: `engine/train/plausibility.py`). "
         "Perplexity: the held-out standard "
         f"library files ({new.get('n_heldout_files')}), each family with its own tokenizer; nats per byte "
         "compare across tokenizers. Reproduce with `python main.py train --evaluate DIR`.",
         "", "| family | plausibility | target loss (nats/token) | target ppl | target nats/byte "
         "| draft nats/byte |", "| --- | --- | --- | --- | --- | --- |"]
    for name, r in (("shipped before", base), ("this family", new)):
        if not r:
            continue
        t, d = r.get("target_heldout", {}), r.get("draft_heldout", {})
        L.append(f"| {name} | {fmt(r.get('plausibility'), 3)} ({r.get('plausible')}/{r.get('n_signatures')}) "
                 f"| {fmt(t.get('loss'))} | {fmt(t.get('ppl'), 2)} | {fmt(t.get('nats_per_byte'))} "
                 f"| {fmt(d.get('nats_per_byte'))} |")
    L.append("")
    return L


def model_card(report: dict, files: list[dict], alpha_text: Optional[str] = None) -> str:
    p, st, sl = report["preset"], report["stages"], report["heldout_sample_losses"]
    tokm, tgt, drf = st.get("tokenizer", {}), st.get("target", {}), st.get("draft", {})
    dis, med, eag, eg3 = st.get("distill"), st.get("medusa"), st.get("eagle"), st.get("eagle3")
    sgen = st.get("selfgen")
    total_s = sum(m.get("wall_s", 0) for m in st.values())
    by_hw: dict = {}
    for m in st.values():
        by_hw[m.get("hardware")] = by_hw.get(m.get("hardware"), 0.0) + m.get("wall_s", 0)
    hw_text = "; ".join(f"{s:.0f} s on {hw}" for hw, s in by_hw.items())
    with_packages = tokm.get("corpus", "stdlib") != "stdlib"
    heads_text = "4 Medusa heads, one EAGLE head" + (" and one EAGLE-3 head" if eg3 else "")
    L = [
        "# specplay shipped model family",
        "",
        f"A small Llama-architecture target, a smaller draft, {heads_text}, trained from "
        "scratch by `engine/train/` (`python main.py train`) on "
        + ("the Python standard library's source and permissively licensed installed packages. "
           if with_packages else "the Python standard library's source. ")
        + "Every number below was measured by that code; the metrics are in `train_report.json` "
        f"(preset `{p['name']}`), "
        "the console log, where kept, in `train_log.txt`.",
        "",
        "## Data",
        *data_lines(p, tokm),
        f"- {tokm.get('n_files')} files, {tokm.get('total_bytes')} bytes; "
        f"corpus sha256 `{tokm.get('corpus_sha256')}`.",
        f"- Split by file (sha256 of the relative path): {tokm.get('n_val_files')} validation files "
        f"(~{p['val_fraction']:.0%}); {tokm.get('train_tokens')} train tokens, {tokm.get('val_tokens')} "
        f"validation tokens.",
        f"- `heldout_prompts.json`: {tokm.get('n_prompts')} code prefixes (100-300 characters, cut at line "
        f"ends) from standard-library validation files; `heldout_sample.txt`: {tokm.get('sample_bytes')} "
        f"bytes of standard-library validation text.",
        "",
        "## Tokenizer",
        f"Byte-level BPE (`tokenizers`), {tokm.get('vocab_size')} tokens incl. `<s>`=0, `</s>`=1, `<pad>`=2, "
        f"`<unk>`=3; trained on the training split only"
        + (f" ({tokm.get('bpe_bytes')} bytes of it, a fixed sample by path hash)" if tokm.get("bpe_bytes")
           and tokm.get("bpe_bytes") < tokm.get("train_bytes", 0) else "")
        + f"; {tokm.get('bytes_per_token')} bytes/token on it. "
        f"`<s>` is prepended on encode; documents were `<s> file </s>`. Exact round trip of the validation "
        f"text (whitespace included): {tokm.get('roundtrip_exact')}.",
        "",
        "## Models",
        "| model | shape | parameters | fp16 bytes |",
        "| --- | --- | --- | --- |",
        f"| target | {shape_line(p['target'])}, tied embeddings, context {p['seq_len']} | "
        f"{tgt.get('params')} | {tgt.get('fp16_bytes')} |",
        f"| draft | {shape_line(p['draft'])}, tied embeddings, context {p['seq_len']} | "
        f"{drf.get('params')} | {drf.get('fp16_bytes')} |",
        medusa_row(p, (report.get("medusa_retrain") or {}).get("stages", {}).get("medusa") or med),
        f"| EAGLE head | fc (2H -> H) + 1 Llama decoder layer, frozen target embeddings/norm/lm_head | "
        f"{eag and eag.get('params')} | {eag and 2 * eag['params']} |",
    ]
    if eg3:
        L.append(f"| EAGLE-3 head | proj (outputs of target layers {eg3.get('tap_layers')} side by side -> "
                 f"H) + fc (2H -> H) + 1 Llama decoder layer (MLP {eg3.get('intermediate_size')}), frozen "
                 f"target embeddings/norm/lm_head | {eg3.get('params')} | {2 * eg3['params']} |")
    head_len = p.get("head_seq_len") or p["seq_len"]
    L += [
        "",
        "## Recipe",
        f"Seed {p['seed']}; AdamW (0.9, 0.95), grad clip 1.0, linear warm-up then cosine to 10% of the peak, "
        "the cosine following whichever of the step count or the wall-clock cap runs out first; evaluation "
        f"on {p['eval_windows']} fixed validation windows of {p['seq_len']} tokens, keeping the best "
        "snapshot; bf16 autocast on CUDA.",
        f"- target: next-token CE; {sched_line(p['target_sched'])}.",
        f"- draft: next-token CE; {sched_line(p['draft_sched'])}.",
        f"- distillation: KL(target || draft) at T=1 on corpus batches; {sched_line(p['distill_sched'])}.",
    ]
    if sgen:
        L.append(f"- the target's own text: {sgen.get('train_sequences')} continuations of random training "
                 f"windows ({sgen.get('prompt_len')}-token prompts, {sgen.get('width')} tokens each; "
                 f"{sgen.get('greedy_sequences')} greedy, the rest sampled at T = {sgen.get('temperature')}) "
                 f"and {sgen.get('val_sequences')} greedy ones of validation windows (held out). The heads' "
                 f"batches are {p.get('gen_fraction', 0.5):.0%} this text, the rest corpus windows of "
                 f"{head_len} tokens.")
    medusa_loss = MEDUSA_LOSSES.get((med or {}).get("loss"), "mean CE of the heads (target frozen)")
    L += [
        f"- Medusa: {medusa_loss}; {sched_line(p['medusa_sched'])}.",
        f"- EAGLE: smooth-L1(feature) + {p['eagle_ce_weight']} x CE(next-next token) (target frozen); "
        f"{sched_line(p['eagle_sched'])}.",
    ]
    if eg3 and p.get("eagle3_sched"):
        L.append(f"- EAGLE-3: training-time test over {eg3.get('steps')} steps (step s+1 reads the head's "
                 "own step-s outputs and attends to the true rows and its own chain, as when drafting), CE "
                 "against the target's own distribution at every step, step weights "
                 f"{eg3.get('decay')}^(s-1) (target frozen); {sched_line(p['eagle3_sched'])}.")
    L += [
        "",
        f"Training time: {total_s:.0f} s in total ({hw_text}). Each run keeps the snapshot with the best "
        "validation score (column 'kept snapshot'); later evaluations are in `train_report.json`.",
        "",
        *stage_time_rows(st),
        "",
        "## Validation",
        "| model | val loss (nats/token) | perplexity |",
        "| --- | --- | --- |",
        f"| unigram baseline (train counts) | {fmt(tokm.get('unigram_val_loss'))} | "
        f"{fmt(math.exp(tokm['unigram_val_loss']) if tokm.get('unigram_val_loss') else None, 1)} |",
        f"| target | {fmt(tgt.get('val_loss'))} | {fmt(tgt.get('val_ppl'), 2)} |",
        f"| draft (pre-trained) | {fmt(drf.get('val_loss'))} | {fmt(drf.get('val_ppl'), 2)} |",
    ]
    if dis:
        L.append(f"| draft (distilled, shipped) | {fmt(dis['after']['val_loss'])} | "
                 f"{fmt(dis['after']['val_ppl'], 2)} |")
    L += ["",
          f"On `heldout_sample.txt` ({sl.get('n_tokens')} tokens, shipped fp16 weights, windows of 512): "
          f"target {fmt(sl.get('target'))}, draft {fmt(sl.get('draft'))}, the text's own unigram entropy "
          f"{fmt(sl.get('unigram_self_entropy'))} nats/token.", ""]
    L += evaluation_lines(report)
    if dis:
        b, a = dis["before"], dis["after"]
        L += ["## Draft vs target (proxy for acceptance)",
              "Greedy top-1 agreement (argmax draft == argmax target) on the validation windows:",
              "", "| | top-1 agreement | KL(target || draft) |", "| --- | --- | --- |",
              f"| before distillation | {fmt(b['top1_agreement'])} | {fmt(b['kl_target_draft'])} |",
              f"| after distillation | {fmt(a['top1_agreement'])} | {fmt(a['kl_target_draft'])} |", ""]
    retrain = report.get("medusa_retrain")
    if retrain:
        med = retrain["stages"]["medusa"]
    if med:
        f = med["final"]
        g = med.get("final_generated") or {}
        L += ["## Medusa heads (validation)"]
        if retrain:
            L += [retrain_line(retrain, st.get("medusa")), ""]
        L += ["Top-k: the head's candidates against the validation text's tokens"
              + ("; 'own text': against the target's held-out greedy continuations" if g else "") + ".", "",
              "| head | predicts | top-1 | top-5 |" + (" top-1 (own text) | top-5 (own text) |" if g else ""),
              "| --- | --- | --- | --- |" + (" --- | --- |" if g else "")]
        L += [f"| {k} | t+{k + 1} | {fmt(f[f'head{k}_top1'])} | {fmt(f[f'head{k}_top5'])} |"
              + (f" {fmt(g.get(f'head{k}_top1'))} | {fmt(g.get(f'head{k}_top5'))} |" if g else "")
              for k in range(1, p["medusa_heads"] + 1)]
        where = ("the target's held-out greedy text" if med.get("tree_calibrated_on") == "generated"
                 else "validation windows")
        L += ["", "`target/medusa_config.json` holds `path_accuracy`: for the 64 paths of head candidates "
              "most often right all the way, the fraction of held-out positions where they were, measured on "
              f"{where}; each round the drafter keeps, of the table's 32 top entries, the tree's nodes "
              "its heads score highest at that position.", ""]
    if eag:
        f = eag["final"]
        L += ["## EAGLE head (validation, autoregressive)",
              "Step s predicts the token s positions past the target's last known one; step 2+ feeds back "
              "the predicted feature and the predicted token's embedding. `chain` = steps 1..s all right.",
              "",
              "| step | top-1 | chain |", "| --- | --- | --- |"]
        L += [f"| {s} | {fmt(f[f'step{s}_top1'])} | {fmt(f[f'chain{s}_top1'])} |" for s in range(1, 5)]
        L.append("")
    retrain3 = report.get("eagle3_retrain")
    if retrain3:
        family_eg3, eg3 = eg3, retrain3["stages"]["eagle3"]
    if eg3:
        f, g = eg3["final"], eg3.get("final_generated") or {}
        steps = eg3.get("steps", 4)
        L += ["## EAGLE-3 head (validation, training-time test)"]
        if retrain3:
            L += [eagle3_retrain_line(retrain3, family_eg3), ""]
        L += [
              "Step s: the head's s-th draft of a chain, reading its own outputs from step 2 on; top-1 = its "
              "argmax equals the target's; `chain` = steps 1..s all agree (greedy acceptance of a chain of "
              "s, with the text's tokens fed). On validation windows and on the target's own held-out greedy "
              "text.", "",
              "| step | top-1 | chain | top-1 (own text) | chain (own text) |",
              "| --- | --- | --- | --- | --- |"]
        L += [f"| {s} | {fmt(f.get(f'step{s}_top1'))} | {fmt(f.get(f'chain{s}_top1'))} | "
              f"{fmt(g.get(f'step{s}_top1'))} | {fmt(g.get(f'chain{s}_top1'))} |"
              for s in range(1, steps + 1)]
        L.append("")
    L += [ALPHA_SECTION, "",
          alpha_text or "_Not measured yet: run `python main.py bench methods` (CPU) and "
                        "`--device cuda` (GPU) on this family and record α, tokens per forward and the "
                        "speedups here._", "",
          "## Files", "| file | bytes | sha256 |", "| --- | --- | --- |"]
    L += [f"| {r['path']} | {r['bytes']} | {r['sha256']} |" for r in files]
    L.append("")
    return "\n".join(L)


def medusa_row(p: dict, med: Optional[dict]) -> str:
    """The models table's row of the shipped Medusa heads (those retrained alone where they were)."""
    layers = (med or {}).get("layers", 1)
    blocks = "residual SiLU block" if layers == 1 else f"{layers} residual SiLU blocks"
    params = med and med.get("params")
    stored = "" if not params or layers == 1 else " (shipped as int8 matrices with an fp16 scale a row)"
    return (f"| Medusa heads | {p['medusa_heads']} x {blocks} (H x H + bias each), shared frozen lm_head | "
            f"{params} | {params and 2 * params}{stored} |")


MEDUSA_LOSSES = {
    "self-distillation": "self-distillation: CE against the target's own distribution at each head's offset "
                         "(Medusa-2 style, target frozen)",
    "cross-entropy against the target's greedy text": (
        "the target's greedy text: continuations of the tokens before a line end of standard-library "
        "training files (and, where the recipe has them, of whole lines from a top-level line, the held-out "
        "prompts' form), the target's final-normed "
        "features computed once, head d trained by CE to rank first the text's token t+1+d at every position "
        "t from the prompt's last token on, what a greedy round drafting from t accepts (target frozen); the "
        "snapshot kept is the one with the lowest loss on the held-out greedy text"),
}


def _retrained_alone(retrain: dict, stage: str) -> str:
    """The card's first sentence on a head stage (medusa, eagle3) retrained alone, from its report."""
    sgen, head = retrain["stages"].get("selfgen") or {}, retrain["stages"][stage]
    text, cpu = head.get("greedy_text"), str(head.get("hardware", "")).startswith("CPU")
    if text:
        top, top_val = text.get("top_level_sequences", 0), text.get("top_level_val_sequences", 0)
        data = (f"{text['sequences']} greedy continuations by the target of the {text['prompt_len']} tokens "
                f"before a line end of standard-library training files"
                + (f" and {top} of 100 to 300 characters of whole lines from a top-level line of the same "
                   f"files (the held-out prompts' form)" if top else "")
                + f" ({text['new_tokens']} new tokens; {text['positions']} positions; "
                f"{text['val_sequences'] + top_val} more held out, no validation file read)")
        if head.get("layers", 1) > 1:
            data += (f"; {head['layers']} residual blocks a head, shipped as int8 matrices with an fp16 "
                     f"scale a row")
    else:
        data = (f"{sgen.get('train_sequences')} continuations of the target's own text, "
                f"{sgen.get('greedy_sequences')} of them greedy")
    return ("Retrained alone on this target (`main.py train --from-family`, "
            f"`scripts/training/train_{stage}_{'cpu' if cpu else 'gpu'}.sh`; "
            "the target and tokenizer as shipped; "
            f"{data}; {head.get('steps_done')} steps in "
            f"{head.get('wall_s')} s on {head.get('hardware')}; {sched_line(retrain[f'{stage}_sched'])}).")


def eagle3_retrain_line(retrain: dict, family_eagle3: Optional[dict]) -> str:
    """What the card says of an EAGLE-3 head retrained alone (export_eagle3_only's report)."""
    line = _retrained_alone(retrain, "eagle3")
    if retrain.get("eagle3_arch") == "published":
        line += (" In the published EAGLE-3 architecture (its attention reads [input_layernorm(embedding) ; "
                 "hidden_norm(g)], its own norm and LM head), shipped in the speculators layout as "
                 "`target/eagle3/`; its draft vocabulary cut to the tokens most frequent in the training "
                 "split (`python -m engine.train.draft_vocab`, the size and coverage in its config.json; "
                 "the tables here are the head before the cut).")
    if family_eagle3:
        old_g, steps = family_eagle3.get("final_generated") or {}, family_eagle3.get("steps", 4)
        chain = fmt(old_g.get(f"chain{steps}_top1"))
        line += f" The family run's head it replaces: chain of {steps} {chain} on the target's own text."
    return line


def retrain_line(retrain: dict, family_medusa: Optional[dict]) -> str:
    """What the card says of heads retrained alone on the shipped target (export_medusa_only's report)."""
    line = _retrained_alone(retrain, "medusa")
    if family_medusa:
        old_f, old_g = family_medusa["final"], family_medusa.get("final_generated") or {}
        line += (f" The family run's heads they replace: head 1 top-1 {fmt(old_f.get('head1_top1'))} on "
                 f"validation text, {fmt(old_g.get('head1_top1'))} on the target's own text.")
    return line


def merge_medusa_retrain(models_dir: Path, medusa_report: Path, device="cpu") -> dict:
    """Record heads retrained alone (export_medusa_only's medusa_report.json, the heads already copied into
    target/) in train_report.json as medusa_retrain, and refresh the card."""
    return merge_retrain(models_dir, medusa_report, "medusa", device)


def merge_retrain(models_dir: Path, head_report: Path, stage: str, device="cpu") -> dict:
    """Record a head retrained alone (medusa or eagle3: its <stage>_report.json, the files already copied
    into target/) in train_report.json as <stage>_retrain, and refresh the card."""
    record_retrain(models_dir, head_report, stage)
    return refresh_card(models_dir, device)


def record_retrain(models_dir: Path, head_report: Path, stage: str) -> None:
    """train_report.json's <stage>_retrain = the retrained head's report (the card is not rewritten)."""
    report_path = models_dir / "train_report.json"
    report = json.loads(report_path.read_text())
    report[f"{stage}_retrain"] = json.loads(head_report.read_text())
    report_path.write_text(json.dumps(report, indent=1))


# ----------------------------------------------------------------------------- refresh

def alpha_section(card: str) -> Optional[str]:
    """The body of the α section of an existing card (kept when the card is rewritten)."""
    if ALPHA_SECTION not in card:
        return None
    body = card.split(ALPHA_SECTION, 1)[1].split("\n## Files", 1)[0].strip()
    return body or None


def refresh_card(models_dir: Path, device="cpu") -> dict:
    """Re-measure the held-out-sample losses of a shipped directory and rewrite train_report.json and the
    card (sha256 table included), keeping the α section as it is. For when a shipped file changes."""
    report_path = models_dir / "train_report.json"
    report = json.loads(report_path.read_text())
    report["heldout_sample_losses"] = heldout_sample_losses(models_dir, device)
    sample = (models_dir / "heldout_sample.txt").read_bytes()
    report["stages"]["tokenizer"]["sample_bytes"] = len(sample)
    report["refreshed"] = time.strftime("%Y-%m-%d %H:%M:%S")
    report_path.write_text(json.dumps(report, indent=1))
    card_path = models_dir / "README.md"
    alpha = alpha_section(card_path.read_text()) if card_path.exists() else None
    files = file_table(models_dir)
    card_path.write_text(model_card(report, files, alpha))
    return report


if __name__ == "__main__":
    import argparse

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    ap = argparse.ArgumentParser(description="re-measure held-out losses and rewrite a shipped model card")
    ap.add_argument("models_dir", type=Path)
    ap.add_argument("--medusa-report", type=Path, default=None,
                    help="medusa_report.json of heads retrained alone (already copied into target/)")
    ap.add_argument("--eagle3-report", type=Path, default=None,
                    help="eagle3_report.json of an EAGLE-3 head retrained alone (copied into target/)")
    args = ap.parse_args()
    for stage, head_report in (("medusa", args.medusa_report), ("eagle3", args.eagle3_report)):
        if head_report is not None:
            record_retrain(args.models_dir, head_report, stage)
    res = refresh_card(args.models_dir)
    print(json.dumps(res["heldout_sample_losses"], indent=1))
