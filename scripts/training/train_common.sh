#!/usr/bin/env bash
# The training scripts' shared helpers: sourced by scripts/training/train_family_gpu.sh,
# scripts/training/train_medusa_gpu.sh and scripts/training/train_eagle3_gpu.sh (they set RUN and BUDGET_S;
# this answers their --help and sets the strict mode and the defaults of OUT, FAMILY, PY, DEVICE and
# TRAIN_ARGS), not run on its own.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then   # run, not sourced: the comment above is the usage
  awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
  [[ "${1:-}" == -h || "${1:-}" == --help ]] && exit 0; exit 2
fi
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then   # the sourcing script's usage: its top comment
  awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0
fi
set -uo pipefail
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=true
OUT=${OUT:-out}
FAMILY=${FAMILY:-assets/models}   # the shipped family (the head-only scripts and their bench)
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
TRAIN_ARGS=${TRAIN_ARGS:-}    # e.g. --tiny for a dry run on a CPU machine (DEVICE=cpu, FAMILY=a tiny export)
mkdir -p "$OUT"
LOG="$OUT/train_log.txt"
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }   # seconds since the script started
collect() {   # the finished stages' metrics, one JSON object (cheap; run after the pipeline and on exit)
  $PY scripts/training/stage_metrics.py "$RUN" "$OUT/stage_metrics.json" 2>/dev/null || true
}

bench_new_head() {   # $1: the methods; the rest: files in $OUT to copy over the shipped target/ (BUDGET_S's rest)
  local methods=$1; shift
  if [ $(( BUDGET_S - $(elapsed) )) -le 60 ]; then
    echo "== bench skipped ($(elapsed) s used)" | tee -a "$LOG"; return
  fi
  local left=$(( BUDGET_S - $(elapsed) - 10 ))
  local bench; bench=$(mktemp -d)   # not under $OUT: the target's weights must not come back
  cp -r "$FAMILY/target" "$bench/target"
  for name in "$@"; do cp "$OUT/$name" "$bench/target/"; done
  echo "== bench methods of the shipped target with the new files (${left} s at most)" | tee -a "$LOG"
  timeout "$left" $PY main.py bench methods --target "$bench/target" --draft "$FAMILY/draft" \
    --methods "$methods" --k 4 --prompts 8 --max-new-tokens 128 \
    --device "$DEVICE" 2>&1 | tee "$OUT/bench.txt" | tee -a "$LOG"
  rm -rf "$bench"
}

start_watcher() {   # stage_metrics.json stays current even if the run is killed hard; sets WATCHER
  ( while sleep 15; do collect; done ) &
  WATCHER=$!
}

print_versions() {   # $1: the run's title line; fails (status 2) when torch or transformers cannot load
  {
    echo "== $1, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    $PY -c 'import torch, transformers, tokenizers; print("torch", torch.__version__, "transformers", transformers.__version__, "tokenizers", tokenizers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")' || exit 2
    nproc
  } 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || return 2
}

begin_run() {   # $1: the run's title line; $2: what to run on exit after collect. Traps, watcher, versions
  # shellcheck disable=SC2064
  trap "collect; $2" EXIT
  trap 'echo "== stopped by a signal after $(elapsed) s" >> "$LOG"; exit 143' TERM INT
  start_watcher
  print_versions "$1" || exit 2
}

train_pipeline() {   # main.py train with these arguments and TRAIN_ARGS, logged; sets rc, stops the watcher
  # shellcheck disable=SC2086
  $PY main.py train "$@" $TRAIN_ARGS 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  kill "$WATCHER" 2>/dev/null
  collect
  echo "== pipeline exit $rc after $(elapsed) s" | tee -a "$LOG"
}
