#!/usr/bin/env bash
# Retrain the whole shipped family on one CUDA GPU (about 8 minutes on an H200, corpus and evaluation
# included) and pack it for the trip back:
#   OUT=/some/dir bash scripts/training/train_family_gpu.sh
# Run from the repository root. Stages (engine/train, preset `full`): corpus + tokenizer, target, draft,
# distill, the target's own text, Medusa, EAGLE, EAGLE-3, export, then the held-out evaluation of the new
# family and of the shipped one (assets/models) for the before/after; then, if time is left, a short
# `bench methods` of the new family (tokens per target forward).
#
# Writes to $OUT, as it goes (so a run stopped at its limit still brings back what finished):
#   train_log.txt           everything printed (PYTHONUNBUFFERED)
#   stage_metrics.json      every finished stage's metrics, rewritten after each stage
#   report.json             the final report (the export's train_report.json), at the end
#   target_model.safetensors  the new target's weights (the one file over 8 MiB)
#   family_rest.tar         everything else of the exported family (assets/models layout, without the target
#                           weights); if the export did not finish: the finished stages' checkpoints instead
#   bench.txt               the bench's table, when it ran
# Unpack here with: bash scripts/training/unpack_family.sh <folder with those files> [assets/models]
RUN=${RUN:-/tmp/specplay_run}
EXPORT=${EXPORT:-/tmp/specplay_family}
BUDGET_S=${BUDGET_S:-510}     # the whole script's wall clock; the bench runs only in what is left of it
source "$(dirname "$0")/train_common.sh"   # answers --help; strict mode, defaults; makes $OUT, sets LOG

pack() {
  if [ -f "$EXPORT/target/model.safetensors" ] && [ -f "$EXPORT/README.md" ]; then
    cp "$LOG" "$EXPORT/train_log.txt" 2>/dev/null
    cp "$EXPORT/target/model.safetensors" "$OUT/target_model.safetensors"
    tar cf "$OUT/family_rest.tar" -C "$EXPORT" --exclude=./target/model.safetensors --exclude=./done.json \
      --exclude=./metrics.json .
    [ -f "$EXPORT/train_report.json" ] && cp "$EXPORT/train_report.json" "$OUT/report.json"
  elif [ -d "$RUN" ]; then   # no export: the checkpoints, without the token streams (rebuilt in a minute)
    tar cf "$OUT/family_rest.tar" -C "$RUN" --exclude='./data/*.npy' --exclude='./selfgen/*.npy' \
      --exclude='./data/manifest_full.json' . 2>/dev/null
  fi
  ls -la "$OUT"
}
begin_run "specplay family training" pack

BASELINE=()
if [ -f assets/models/target/config.json ]; then BASELINE=(--baseline assets/models); fi
# one process for every stage (a CUDA context and the imports once); each stage leaves <RUN>/<stage>/done.json
train_pipeline --out "$RUN" --device "$DEVICE" --export "$EXPORT" "${BASELINE[@]}"

if [ "$rc" = 0 ] && [ $(( BUDGET_S - $(elapsed) )) -gt 75 ]; then
  left=$(( BUDGET_S - $(elapsed) - 20 ))
  echo "== bench methods of the new family (${left} s at most)" | tee -a "$LOG"
  timeout "$left" $PY main.py bench methods --target "$EXPORT/target" --draft "$EXPORT/draft" \
    --methods none,draft,medusa,eagle,eagle:8,eagle3,eagle3:8 --k 4 --prompts 8 --max-new-tokens 128 \
    --device "$DEVICE" 2>&1 | tee "$OUT/bench.txt" | tee -a "$LOG"
else
  echo "== bench skipped ($(elapsed) s used)" | tee -a "$LOG"
fi
echo "== done after $(elapsed) s" | tee -a "$LOG"
exit "$rc"
