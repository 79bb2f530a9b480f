#!/usr/bin/env bash
# The shipped recipe on one CUDA GPU (about 9 minutes on an H200).
#   OUT=/some/dir bash engine/train/gpu_recipe.sh
# Uses runs/full/data if it is there (tokenizer stage run beforehand, e.g. on a CPU machine, and carried),
# otherwise builds it from this interpreter's standard library. Writes to $OUT: smoke.log (the --tiny preset
# on the GPU, run first so a broken environment fails in seconds), train.log, and the exported family as
# models.tar.aa, models.tar.ab, ... (split to 15 MB; `cat models.tar.* | tar xf - -C assets/models`).
# If a stage fails, the finished checkpoints come back instead as ckpt.tar.* (re-run to resume).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
RUN=${RUN:-runs/full}
PY=${PY:-python3}
EXPORT=${EXPORT:-/tmp/specplay_export}
mkdir -p "$OUT"
$PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())' || exit 2
if [ "${SMOKE:-1}" = 1 ]; then
  rm -rf /tmp/specplay_tiny
  if ! $PY -m engine.train.cli --tiny --out /tmp/specplay_tiny --device cuda > "$OUT/smoke.log" 2>&1; then
    tail -n 60 "$OUT/smoke.log"; exit 3
  fi
  echo "smoke test (--tiny on cuda) passed"
fi
$PY -m engine.train.cli --out "$RUN" --device cuda --export "$EXPORT" 2>&1 | tee "$OUT/train.log"
rc=${PIPESTATUS[0]}
if [ "$rc" = 0 ]; then
  tar cf - -C "$EXPORT" . | split -b 15M - "$OUT/models.tar."
else
  tar cf - -C "$RUN" --exclude=./data . | split -b 15M - "$OUT/ckpt.tar."
fi
ls -la "$OUT"
exit "$rc"
