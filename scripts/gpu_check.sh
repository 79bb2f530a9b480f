#!/usr/bin/env bash
# Everything the lent GPU must confirm, in one call: run from the repo root on the device machine, logs to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import torch, transformers, cupy; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cupy', cupy.__version__)"
echo "== CPU-side suites under this machine's transformers"
[[ -n ${SKIP_CPU:-} ]] || python3 -m pytest -q -p no:cacheprovider -m "not gpu" tests/test_llama_runner.py tests/test_models.py tests/test_decoder.py \
  tests/test_analytic.py 2>&1 | tee "$OUT/cpu_suites.log" | tail -2
echo "== one target step: kernels, eager vs CUDA graph"
python3 scripts/step_timing.py 2>&1 | grep -v -i warn | tee "$OUT/step_timing.txt"
echo "== GPU tests"
SPECPLAY_FUZZ_CASES=${SPECPLAY_FUZZ_CASES:-10000} python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
  tests/test_kernels_gpu.py tests/test_engine_gpu.py tests/test_timing.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
M=none,draft,ngram,medusa,eagle,eagle:8,lookahead
echo "== bench methods, shipped pair, greedy, bf16"
python3 main.py bench methods --device cuda --methods $M --k 4 --prompts 8 --max-new-tokens 128 2>&1 | tee "$OUT/bench_gpu.txt"
echo "== bench graphs: every method eager and with CUDA graphs, greedy"
python3 main.py bench graphs --device cuda --methods $M --k 4 --prompts 8 --max-new-tokens 128 2>&1 | tee "$OUT/bench_graphs.txt"
echo "== bench methods, T=0.8"
python3 main.py bench methods --device cuda --methods $M --k 4 --prompts 8 --max-new-tokens 128 --temperature 0.8 2>&1 \
  | tee -a "$OUT/bench_gpu.txt"
echo "== k-sweep draft"
python3 main.py bench k-sweep --device cuda --method draft --ks 1,2,3,4,6,8 --prompts 8 --max-new-tokens 128 2>&1 \
  | tee -a "$OUT/bench_gpu.txt"
echo "== check-lossless on CUDA (fp32)"
for m in draft eagle; do python3 main.py check-lossless --device cuda --dtype float32 --method $m --k 4 --samples 1000 2>&1; done \
  | tee "$OUT/lossless_gpu.txt"
echo "== bench kernels"
python3 main.py bench kernels 2>&1 | tee "$OUT/bench_kernels.txt"
