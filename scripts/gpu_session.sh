#!/usr/bin/env bash
# One device call, most important first (a run cut short keeps what came first); logs to $OUT.
# PART=all (default): every GPU test (10,000 fuzz cases per kernel), bench runtimes on the synthetic 1B and 7B
# shapes, the batched regime at B = 1 and 64, the GPU K sweep of the shipped pair, then programmatic launch on
# against off. PART=short: the tests and the two runtimes tables only.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PART=${PART:-all}
nvidia-smi -L
SPECPLAY_FUZZ_CASES=10000 timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rs $(ls tests/*_gpu.py) \
  2>&1 | grep -v -i "warn" | tee "$OUT/gpu_tests.log" | tail -8
for shape in llama-1b llama-7b; do
  timeout 90 python3 main.py bench runtimes --device cuda --synthetic $shape --methods none,draft --k 4 --prompts 4 \
    --max-new-tokens 128 --hf hf-eager,hf-assisted 2>&1 | grep -v "compiling\|generation_config" \
    | tee -a "$OUT/runtimes_synthetic.txt" | tail -7
done
[ "$PART" = short ] && exit 0
timeout 80 python3 main.py bench batch --device cuda --synthetic llama-8b --batches 1,64 --method draft --k 4 \
  --ks 4 2>&1 | grep -v "compiling" | tail -12 | tee "$OUT/batch_llama8b.txt"
timeout 80 python3 main.py bench k-sweep --device cuda --method draft --ks 1,2,3,4,6,8 --prompts 4 \
  --max-new-tokens 128 2>&1 | grep -v "compiling" | tee "$OUT/ksweep_gpu.txt" | tail -12
for pdl in 1 0; do
  SPECPLAY_PDL=$pdl timeout 40 python3 scripts/profile_e2e.py --synthetic llama-1b --methods none --top 4 2>&1 \
    | grep -v "compiling\|USDT" > "$OUT/e2e_llama-1b_pdl$pdl.txt"; grep "^==\|GPU busy" "$OUT/e2e_llama-1b_pdl$pdl.txt"
done
