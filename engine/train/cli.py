"""`python main.py train ...`: train the shipped model family (or a tiny CPU smoke version).

    python main.py train --tiny --out /tmp/tiny                   # all stages on CPU, < 1 minute
    python main.py train --out runs/full --export assets/models   # the real recipe (one GPU, < 20 min)
    python main.py train --out runs/full --stages tokenizer       # one stage (finished stages are skipped)
    python main.py train --evaluate assets/models --limit 50      # plausibility + held-out perplexity only
    python main.py train --ngram-table assets/models/target       # n-gram's corpus table for its tokenizer

Retrain only the Medusa heads of an exported family (scripts/training/train_medusa_gpu.sh on a GPU):

    python main.py train --from-family assets/models --out runs/medusa --medusa-budget-s 150 \\
        --medusa-steps 20000 --export-medusa runs/medusa/heads
    cp runs/medusa/heads/medusa_heads.safetensors runs/medusa/heads/medusa_config.json assets/models/target/

or only the EAGLE-3 head (scripts/training/train_eagle3_gpu.sh):

    python main.py train --from-family assets/models --out runs/eagle3 \\
        --stages tokenizer,target,selfgen,eagle3 --eagle3-budget-s 200 --eagle3-steps 20000 \\
        --export-eagle3 runs/eagle3/head

--from-family DIR takes the tokenizer (DIR/target/tokenizer.json; the corpus is built and encoded with it, no
BPE is trained) and the target (DIR/target, copied, not pre-trained) from DIR, which must match the preset
(--tiny for a family made with --tiny); its stages default to tokenizer,target,selfgen,medusa. --export-medusa
OUT writes only the heads (fp16, with their measured path accuracies) and medusa_report.json to OUT;
--export-eagle3 OUT the EAGLE-3 head (fp16) and eagle3_report.json.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from engine.core.threads import check_threads, env_threads
from engine.errors import SpecplayError
from engine.train.presets import PRESETS, STAGES  # not engine.train.stages: it imports torch

FROM_FAMILY_STAGES = ("tokenizer", "target", "selfgen", "medusa")   # --from-family's default: Medusa only


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train the tokenizer, target, draft, Medusa and EAGLE heads",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(p)
    return p


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiny", action="store_true", help="tiny preset: few files, toy dims, CPU, < 1 minute")
    p.add_argument("--out", type=Path, default=None,
                   help="checkpoint directory (default runs/train, or runs/tiny with --tiny)")
    p.add_argument("--stages", default=None,
                   help=f"comma-separated subset of {','.join(STAGES)} (finished stages are skipped; default "
                        f"all, with --from-family {','.join(FROM_FAMILY_STAGES)})")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--export", type=Path, default=None, help="export directory (default <out>/export)")
    p.add_argument("--baseline", type=Path, default=None,
                   help="the eval stage also evaluates this family (e.g. assets/models) for a before/after")
    p.add_argument("--evaluate", type=Path, nargs="+", default=None, metavar="DIR",
                   help="only evaluate these families (plausibility of greedy signature completions, "
                        "held-out stdlib perplexity) and print JSON; no training")
    p.add_argument("--limit", type=int, default=None, help="--evaluate: signatures (default 200)")
    p.add_argument("--max-files", type=int, default=None,
                   help="--evaluate: held-out files for the perplexity (default all)")
    p.add_argument("--json", type=Path, default=None, help="--evaluate: also write the results here")
    p.add_argument("--from-family", type=Path, default=None, metavar="DIR",
                   help="take the tokenizer and the target from this exported family (e.g. assets/models) "
                        "instead of training them, to retrain heads on it")
    p.add_argument("--ngram-table", type=Path, default=None, metavar="DIR",
                   help="only build n-gram's corpus table for the model in DIR (its tokenizer) from the "
                        "standard library's training files, written to DIR/ngram_table.safetensors")
    add_head_arguments(p, "medusa", "Medusa", "Medusa heads (medusa_heads.safetensors, medusa_config.json)")
    add_head_arguments(p, "eagle3", "EAGLE-3", "EAGLE-3 head (eagle3_head.safetensors, eagle3_config.json)")
    p.add_argument("--eagle3-arch", choices=("specplay", "published"), default=None,
                   help="the EAGLE-3 head's architecture: the published one (the full preset's, written in "
                        "the speculators layout: config.json, model.safetensors) or the project's own "
                        "(--tiny's)")
    p.add_argument("--eagle3-draft-vocab", type=int, default=None, metavar="N",
                   help="published EAGLE-3: keep the N most frequent training tokens in its LM head (0: all; "
                        "the full preset keeps 4096)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: OMP_NUM_THREADS, else torch's own; --tiny: up to 4)")
    p.set_defaults(func=run_train)


def add_head_arguments(p: argparse.ArgumentParser, stage: str, title: str, files: str) -> None:
    """--<stage>-budget-s, --<stage>-steps and --export-<stage> for a head stage retrained alone."""
    p.add_argument(f"--{stage}-budget-s", type=float, default=None, metavar="S",
                   help=f"the {title} stage's wall-clock cap (default: the preset's)")
    p.add_argument(f"--{stage}-steps", type=int, default=None,
                   help=f"the {title} stage's step cap (default: the preset's; raise it with the budget)")
    p.add_argument(f"--export-{stage}", type=Path, default=None, metavar="DIR",
                   help=f"after the stages, write only the {files} and {stage}_report.json here")


def parse_stages(text: str | None, from_family: bool = False) -> list[str]:
    if text is None:
        return list(FROM_FAMILY_STAGES if from_family else STAGES)
    stages = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise SpecplayError(f"unknown stage(s) {bad}; choose from {STAGES}")
    return stages


def with_schedule(preset, stage: str, budget_s: float | None, steps: int | None):
    """The preset with a head stage's (medusa, eagle3) time budget and step cap replaced where given (the
    reports record the preset, so they show the schedule that ran)."""
    changes = {k: v for k, v in (("time_budget_s", budget_s), ("steps", steps)) if v is not None}
    if any(v <= 0 for v in changes.values()):
        raise SpecplayError(f"--{stage}-budget-s and --{stage}-steps must be positive, not {changes}")
    if not changes:
        return preset
    field = f"{stage}_sched"
    return replace(preset, **{field: replace(getattr(preset, field), **changes)})


def run_train(args) -> int:
    import torch
    from transformers.utils import logging as hf_logging

    from engine.train import lm
    from engine.train.stages import Context, run_stages

    hf_logging.disable_progress_bar()   # keep the training log readable
    if getattr(args, "evaluate", None):
        return run_evaluate(args)
    if getattr(args, "ngram_table", None) is not None:
        from engine.train.ngram_table import build_ngram_table

        build_ngram_table(args.ngram_table)
        return 0
    family = getattr(args, "from_family", None)
    stages = parse_stages(args.stages, family is not None)
    preset = with_schedule(PRESETS["tiny" if args.tiny else "full"](), "medusa",
                           getattr(args, "medusa_budget_s", None), getattr(args, "medusa_steps", None))
    preset = with_schedule(preset, "eagle3", getattr(args, "eagle3_budget_s", None),
                           getattr(args, "eagle3_steps", None))
    if getattr(args, "eagle3_arch", None) is not None:
        preset = replace(preset, eagle3_arch=args.eagle3_arch)
    if getattr(args, "eagle3_draft_vocab", None) is not None:
        if not 0 <= args.eagle3_draft_vocab <= preset.vocab_size:
            raise SpecplayError(f"--eagle3-draft-vocab must be between 0 and {preset.vocab_size}")
        preset = replace(preset, eagle3_draft_vocab=args.eagle3_draft_vocab)
    out = args.out or Path("runs/tiny" if args.tiny else "runs/train")
    device = lm.pick_device(args.device)
    threads = getattr(args, "threads", None)
    check_threads(threads)
    if threads is not None:
        torch.set_num_threads(threads)
    elif env_threads() is None and args.tiny:
        torch.set_num_threads(min(4, torch.get_num_threads()))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    ctx = Context(preset=preset, out=out, device=device, export_dir=args.export or out / "export",
                  log=lambda msg: print(msg, flush=True), baseline_dir=getattr(args, "baseline", None),
                  family_dir=family)
    t0 = time.time()
    run_stages(ctx, stages)
    if getattr(args, "export_medusa", None) is not None:
        from engine.train.export import export_medusa_only

        export_medusa_only(ctx, args.export_medusa)
    if getattr(args, "export_eagle3", None) is not None:
        from engine.train.export import export_eagle3_only

        export_eagle3_only(ctx, args.export_eagle3)
    print(f"train: finished in {time.time() - t0:.1f} s (preset {preset.name}, out {out})", flush=True)
    return 0


def run_evaluate(args) -> int:
    import json

    from engine.train import lm
    from engine.train.plausibility import SIGNATURES, evaluate_family

    device = lm.pick_device(args.device)
    results = []
    for d in args.evaluate:
        if not (Path(d) / "target" / "config.json").exists():
            raise SpecplayError(f"{d}: no target/config.json (a family directory holds target/ and draft/)")
        r = evaluate_family(Path(d), device, args.limit or SIGNATURES, args.max_files,
                            log=lambda msg: print(msg, flush=True))
        r.pop("examples", None)
        results.append(r)
    text = json.dumps(results, indent=1)
    if args.json is not None:
        args.json.write_text(text)
    print(text)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.train.cli", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(parser)
    args = parser.parse_args(argv)
    return run_train(args)


if __name__ == "__main__":
    sys.exit(main())
