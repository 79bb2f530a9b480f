#!/usr/bin/env bash
# The batch regime on a CUDA GPU, from the repo root; logs, JSON and the SVG plot to $OUT.
#   STAGES="tests shipped synthetic" SHAPE=llama-8b BATCHES=1,2,4,8,16,32,64,128,256 scripts/gpu_batch.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${STAGES:-tests shipped synthetic}
SHAPE=${SHAPE:-llama-8b}
BATCHES=${BATCHES:-1,2,4,8,16,32,64,128,256}
has() { [[ " $STAGES " == *" $1 "* ]]; }
if has tests; then
  echo "== batched greedy equality on CUDA (fp32) and the bench path (bf16)"
  python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_batch_gpu.py 2>&1 | tee "$OUT/batch_gpu_tests.log" \
    | tail -4
fi
if has shipped; then
  echo "== bench batch, shipped pair"
  python3 main.py bench batch --device cuda --batches "$BATCHES" --method draft --k 4 --ks 1,2,3,4,6,8 \
    2>&1 | tee "$OUT/batch_shipped.txt"
fi
if has synthetic; then
  echo "== bench batch, synthetic $SHAPE (random weights, timing only)"
  python3 main.py bench batch --device cuda --synthetic "$SHAPE" --batches "$BATCHES" --method draft --k 4 \
    --ks 1,2,3,4,6,8 --json > "$OUT/batch_$SHAPE.json" 2> "$OUT/batch_$SHAPE.err"
  tail -3 "$OUT/batch_$SHAPE.err"
  python3 - "$OUT/batch_$SHAPE.json" <<'PY' | tee "$OUT/batch_$SHAPE.txt"
import json, sys
from engine.batch_bench import format_json
print(format_json(json.load(open(sys.argv[1]))))
PY
  python3 scripts/plot_batch.py "$OUT/batch_$SHAPE.json" "$OUT/batch_$SHAPE.svg"
fi
