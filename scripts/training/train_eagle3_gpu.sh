#!/usr/bin/env bash
# Retrain only the EAGLE-3 head of the shipped family (assets/models) on one CUDA GPU (about 6 minutes on an
# H200) and bring back the new head, small files only:
#   OUT=/some/dir bash scripts/training/train_eagle3_gpu.sh
# Run from the repository root. Stages (engine/train, preset `full`, --from-family assets/models): corpus +
# encoding with the shipped tokenizer, the shipped target copied as the target checkpoint, the target's own
# text (selfgen: the head trains half on it), EAGLE-3 with a longer budget (EAGLE3_BUDGET_S, default 200 s);
# then the head-only export; then, if time is left, `bench methods none,eagle3,eagle3:8` of the shipped
# target with the new head (a temporary copy of its directory). No other weights are trained or come back.
#
# Writes to $OUT, as it goes (a run stopped at its limit still brings back what finished):
#   train_log.txt             everything printed (PYTHONUNBUFFERED)
#   stage_metrics.json        every finished stage's metrics, rewritten after each stage
#   config.json               the new head (fp16), the published EAGLE-3 architecture in the speculators
#   model.safetensors         layout, its draft vocabulary cut to 4,096 tokens: the shipped target/eagle3/
#   eagle3_report.json        the EAGLE-3 schedule and the target, selfgen and eagle3 stages' metrics
#   bench.txt                 the bench's table, when it ran (the project's architecture only)
# The project's own architecture instead (TRAIN_ARGS="--eagle3-arch specplay"): eagle3_head.safetensors and
# eagle3_config.json, to copy over assets/models/target/ (they win over target/eagle3/ there).
# Ship with:
#   cp $OUT/config.json $OUT/model.safetensors assets/models/target/eagle3/
#   python -m engine.train.export assets/models --eagle3-report $OUT/eagle3_report.json   # card, sha256 table
RUN=${RUN:-/tmp/specplay_eagle3_run}
EAGLE3_BUDGET_S=${EAGLE3_BUDGET_S:-200}
EAGLE3_STEPS=${EAGLE3_STEPS:-20000}   # above what the budget allows (~18 steps/s on an H200): time ends it
BUDGET_S=${BUDGET_S:-420}     # the whole script's wall clock; the bench runs only in what is left of it
source "$(dirname "$0")/train_common.sh"   # answers --help; strict mode, defaults; makes $OUT, sets LOG

begin_run "specplay EAGLE-3-only training on $FAMILY" 'ls -la "$OUT"'

train_pipeline --from-family "$FAMILY" --stages tokenizer,target,selfgen,eagle3 --out "$RUN" \
  --device "$DEVICE" --eagle3-budget-s "$EAGLE3_BUDGET_S" --eagle3-steps "$EAGLE3_STEPS" \
  --export-eagle3 "$OUT"

if [ -f "$OUT/config.json" ]; then   # a published-architecture head: bench it with --heads
  echo "== bench skipped: a published-architecture head (main.py bench methods --heads \$OUT)" | tee -a "$LOG"
else
  [ "$rc" = 0 ] && bench_new_head none,eagle3,eagle3:8 eagle3_head.safetensors eagle3_config.json
fi
echo "== done after $(elapsed) s" | tee -a "$LOG"
exit "$rc"
