#!/usr/bin/env bash
# The GPU tests and the README's GPU tables in one run, most important first (a run cut short keeps what came
# first); logs to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L
echo "== GPU tests"
SPECPLAY_FUZZ_CASES=10000 python3 -m pytest -q -p no:cacheprovider -m gpu -rs $(ls tests/*_gpu.py) tests/test_timing.py \
  2>&1 | grep -v -i "warn" | tee "$OUT/gpu_tests.log" | tail -6
echo "== CPU loading suites under transformers 5.17"
python3 -m pytest -q -p no:cacheprovider -m "not gpu" tests/test_models.py tests/test_llama_runner.py \
  tests/test_model_validation.py tests/test_vocab_and_window.py tests/test_decoder.py 2>&1 | tail -2
echo "== bench methods, shipped pair, greedy"
python3 main.py bench methods --device cuda --methods none,draft,ngram,suffix,medusa,eagle,eagle:8,lookahead,layerskip \
  --k 4 --prompts 8 --max-new-tokens 128 2>&1 | grep -v "compiling" | tee "$OUT/bench_gpu.txt"
for shape in llama-1b llama-7b; do
  echo "== bench runtimes, synthetic $shape"
  python3 main.py bench runtimes --device cuda --synthetic $shape --methods none,draft --k 4 --prompts 4 \
    --max-new-tokens 128 --hf hf-eager,hf-assisted 2>&1 | grep -v "compiling\|generation_config" | tee -a "$OUT/runtimes_synthetic.txt"
done
echo "== bench batch, synthetic llama-8b"
timeout 120 python3 main.py bench batch --device cuda --synthetic llama-8b --batches 1,4,16,64,128 --method draft --k 4 \
  --ks 4 2>&1 | grep -v "compiling" | tail -25 | tee "$OUT/batch_llama8b.txt"
