#!/usr/bin/env bash
# The step kernels' GPU tests, then where the time goes with programmatic dependent launch on and off
# (scripts/profile_e2e.py) and the batched regime at B = 1 and 64; logs to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_step_kernels_gpu.py tests/test_batch_gpu.py \
  2>&1 | grep -v -i "warn" | tee "$OUT/gpu_tests.log" | tail -15
for pdl in 1 0; do
  SPECPLAY_PDL=$pdl timeout 100 python3 scripts/profile_e2e.py --synthetic llama-1b --methods none,draft --top 6 2>&1 \
    | grep -v "compiling\|USDT" > "$OUT/e2e_llama-1b_pdl$pdl.txt"; grep "^==\|GPU busy\|prefill" "$OUT/e2e_llama-1b_pdl$pdl.txt"
done
timeout 100 python3 scripts/profile_e2e.py --synthetic llama-7b --methods none --top 6 2>&1 \
  | grep -v "compiling\|USDT" > "$OUT/e2e_llama-7b.txt"; grep "^==\|GPU busy" "$OUT/e2e_llama-7b.txt"
timeout 100 python3 scripts/profile_e2e.py --synthetic llama-8b --methods "" --batch 64 --top 14 2>&1 \
  | grep -v "compiling\|USDT" > "$OUT/e2e_batch_llama-8b.txt"; grep "^==\|GPU busy" "$OUT/e2e_batch_llama-8b.txt"
timeout 150 python3 main.py bench batch --device cuda --synthetic llama-8b --batches 1,64 --method draft --k 4 \
  --ks 4 2>&1 | grep -v "compiling" | tail -14 | tee "$OUT/batch_llama8b.txt"
