#!/usr/bin/env bash
# The decode kernels on a CUDA machine: their fuzz and bf16 losslessness tests first, then the decode path
# against the cuBLAS + SDPA path (SPECPLAY_DECODE=0) end to end on synthetic shapes and the shipped pair, and
# the per-kernel step profile; run from the repo root, logs to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L
echo "== decode kernel tests (fuzz ${SPECPLAY_FUZZ_CASES:-2000} cases per kernel) and bf16 losslessness"
SPECPLAY_FUZZ_CASES=${SPECPLAY_FUZZ_CASES:-2000} timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -x \
  tests/test_step_kernels_gpu.py tests/test_engine_gpu.py -k "gemv or attention or decode_path or bf16 or fused" \
  2>&1 | grep -v -i warn | tee "$OUT/decode_tests.log" | tail -25
for shape in ${SHAPES:-llama-1b llama-7b}; do
  for decode in ${DECODES:-1 0}; do
    hf=none; [[ $decode == 1 && $shape == llama-7b ]] && hf=hf-assisted
    echo "== bench runtimes, synthetic $shape, SPECPLAY_DECODE=$decode"
    SPECPLAY_DECODE=$decode timeout 200 python3 main.py bench runtimes --device cuda --synthetic $shape \
      --methods none,draft --k 4 --prompts 4 --max-new-tokens 128 --hf $hf 2>&1 \
      | grep -v "compiling\|generation_config" | tee -a "$OUT/runtimes_decode.txt"
  done
done
echo "== bench methods, shipped pair, greedy, bf16"
timeout 200 python3 main.py bench methods --device cuda \
  --methods none,draft,ngram,suffix,medusa,eagle,eagle:8,lookahead,layerskip --k 4 --prompts 8 \
  --max-new-tokens 128 2>&1 | grep -v "compiling" | tee "$OUT/bench_gpu.txt"
echo "== step profiles"
for shape in llama-1b llama-7b; do timeout 150 python3 scripts/profile_step.py --synthetic $shape 2>&1 | tee "$OUT/profile_$shape.txt"; done
