#!/usr/bin/env bash
# Retrain only the Medusa heads of the shipped family (assets/models) on one CUDA GPU and bring back the new
# heads, small files only (scripts/training/train_medusa_cpu.sh: the same on the CPU):
#   OUT=/some/dir bash scripts/training/train_medusa_gpu.sh
# Run from the repository root. Stages (engine/train, preset `full`, --from-family assets/models): corpus +
# encoding with the shipped tokenizer (no BPE training), the shipped target copied as the target checkpoint
# (its validation loss measured), Medusa (the preset's greedy-text recipe, presets.MedusaGreedy) with a
# budget of MEDUSA_BUDGET_S (default 150 s); then the heads-only export; then, if time is left, a short
# `bench methods none,medusa` of the shipped target with the new heads (a temporary copy of its directory).
# This recipe has not been timed on a GPU.
# The target, draft and EAGLE heads are not trained, and no weights but the heads come back.
#
# Writes to $OUT, as it goes (so a run stopped at its limit still brings back what finished):
#   train_log.txt             everything printed (PYTHONUNBUFFERED)
#   stage_metrics.json        every finished stage's metrics, rewritten after each stage
#   medusa_heads.safetensors  the new heads (fp16)                      } to copy over assets/models/target/
#   medusa_config.json        with the path accuracies the tree uses    }
#   medusa_report.json        the Medusa schedule and the target, selfgen and medusa stages' metrics
#   medusa_stage/             only if the run stopped between the medusa stage and the export: its fp32 heads
#   bench.txt                 the bench's table, when it ran
# Ship with:
#   cp $OUT/medusa_heads.safetensors $OUT/medusa_config.json assets/models/target/
#   python -m engine.train.export assets/models --medusa-report $OUT/medusa_report.json   # the card, its file table
RUN=${RUN:-/tmp/specplay_medusa_run}
MEDUSA_BUDGET_S=${MEDUSA_BUDGET_S:-150}
MEDUSA_STEPS=${MEDUSA_STEPS:-20000}   # above what the budget allows (~35 steps/s on an H200): time ends it
BUDGET_S=${BUDGET_S:-390}     # the whole script's wall clock; the bench runs only in what is left of it
source "$(dirname "$0")/train_common.sh"   # answers --help; strict mode, defaults; makes $OUT, sets LOG

keep_heads() {   # the export writes straight into $OUT; if it did not run, the medusa stage's own files
  if [ ! -f "$OUT/medusa_heads.safetensors" ] && [ -f "$RUN/medusa/done.json" ]; then
    mkdir -p "$OUT/medusa_stage"
    cp "$RUN"/medusa/medusa_heads.safetensors "$RUN"/medusa/medusa_config.json "$RUN"/medusa/metrics.json \
      "$OUT/medusa_stage/" 2>/dev/null
  fi
  ls -la "$OUT"
}
begin_run "specplay Medusa-only training on $FAMILY" keep_heads

# one process for every stage and the export; each stage leaves <RUN>/<stage>/done.json
train_pipeline --from-family "$FAMILY" --stages tokenizer,target,medusa --out "$RUN" \
  --device "$DEVICE" --medusa-budget-s "$MEDUSA_BUDGET_S" --medusa-steps "$MEDUSA_STEPS" \
  --export-medusa "$OUT"

[ "$rc" = 0 ] && bench_new_head none,medusa medusa_heads.safetensors medusa_config.json
echo "== done after $(elapsed) s" | tee -a "$LOG"
exit "$rc"
