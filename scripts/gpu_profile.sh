#!/usr/bin/env bash
# Where the end-to-end time goes on the GPU (scripts/profile_e2e.py): synthetic 1B and 7B decode loops and
# prefills, one batched llama-8b step at B = 64; logs to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L
for shape in llama-1b llama-7b; do
  timeout 150 python3 scripts/profile_e2e.py --synthetic $shape --methods none,draft --top 14 2>&1 \
    | grep -v "compiling\|USDT" | tee "$OUT/e2e_$shape.txt"
done
timeout 150 python3 scripts/profile_e2e.py --synthetic llama-8b --methods "" --batch 64 --top 18 2>&1 \
  | grep -v "compiling\|USDT" | tee "$OUT/e2e_batch_llama-8b.txt"
