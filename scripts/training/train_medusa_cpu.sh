#!/usr/bin/env bash
# Retrain only the Medusa heads of the shipped family on this machine's CPU (about 31 minutes on 2 cores, 16 of
# them making the text):
#   OUT=/some/dir bash scripts/training/train_medusa_cpu.sh
# The same run as scripts/training/train_medusa_gpu.sh (see there for what it writes and how to ship the heads) on the
# CPU, with the full preset's own Medusa schedule (3000 steps of 512 positions of the target's greedy text,
# 900 s at most) and no bench at the end (run `bench methods --device cpu` after shipping).
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then   # the comment above is the usage
  awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0
fi
DEVICE=cpu MEDUSA_BUDGET_S=${MEDUSA_BUDGET_S:-900} MEDUSA_STEPS=${MEDUSA_STEPS:-3000} BUDGET_S=${BUDGET_S:-0} \
  exec bash "$(dirname "$0")/train_medusa_gpu.sh"
