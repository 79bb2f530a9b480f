#!/usr/bin/env bash
# The GPU tests and the README's GPU tables in one run, most important first (a run cut short keeps what came
# first); logs to $OUT. PART=tests|tables|batch picks one part (default: all).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PART=${PART:-tests tables batch}
has() { [[ " $PART " == *" $1 "* ]]; }
nvidia-smi -L
if has tests; then
  echo "== GPU tests"
  SPECPLAY_FUZZ_CASES=10000 timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu -rs $(ls tests/*_gpu.py) \
    tests/test_timing.py 2>&1 | grep -v -i "warn" | tee "$OUT/gpu_tests.log" | tail -12
fi
if has tables; then
  echo "== bench methods, shipped pair, greedy"
  timeout 150 python3 main.py bench methods --device cuda --methods none,draft,ngram,suffix,medusa,eagle,eagle:8,lookahead,layerskip \
    --k 4 --prompts 8 --max-new-tokens 128 2>&1 | grep -v "compiling" | tee "$OUT/bench_gpu.txt"
  for shape in llama-1b llama-7b; do
    echo "== bench runtimes, synthetic $shape"
    timeout 150 python3 main.py bench runtimes --device cuda --synthetic $shape --methods none,draft --k 4 --prompts 4 \
      --max-new-tokens 128 --hf hf-eager,hf-assisted 2>&1 | grep -v "compiling\|generation_config" | tee -a "$OUT/runtimes_synthetic.txt"
  done
fi
if has batch; then
  echo "== bench batch, synthetic llama-8b"
  timeout 200 python3 main.py bench batch --device cuda --synthetic llama-8b --batches 1,4,16,64,128,256 --method draft --k 4 \
    --ks 4 2>&1 | grep -v "compiling" | tail -25 | tee "$OUT/batch_llama8b.txt"
  echo "== step profiles"
  for shape in llama-1b llama-7b; do
    timeout 100 python3 scripts/profile_step.py --synthetic $shape 2>&1 | tee "$OUT/profile_$shape.txt" | grep "^n=\|floor"
  done
  echo "== bench k-sweep, shipped pair (measured beside predicted)"
  timeout 200 python3 main.py bench k-sweep --device cuda --method draft --ks 1,2,3,4,6,8 --prompts 4 \
    --max-new-tokens 128 2>&1 | grep -v "compiling" | tee "$OUT/ksweep_gpu.txt"
fi
