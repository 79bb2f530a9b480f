#!/usr/bin/env bash
# Everything a CUDA machine must confirm (GPU tests and benchmarks), run from the repo root; logs to $OUT:
#   OUT=/some/dir bash scripts/gpu/check.sh
# STAGES picks parts (default: all): tests bench runtimes synthetic lossless kernels
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then   # the comment above is the usage
  awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0
fi
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${STAGES:-tests bench runtimes synthetic lossless kernels}
has() { [[ " $STAGES " == *" $1 "* ]]; }
nvidia-smi -L
python3 -c "import torch, transformers, cupy; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cupy', cupy.__version__)"
M=none,draft,ngram,suffix,medusa,eagle,eagle:8,lookahead,layerskip
if has tests; then
  echo "== GPU tests (kernel fuzz ${FUZZ_CASES:-10000} cases per kernel, engine on CUDA)"
  python3 -m pytest -q -p no:cacheprovider -m gpu -rs --fuzz-cases "${FUZZ_CASES:-10000}" \
    $(ls tests/*_gpu.py) tests/test_timing.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
  echo "== CPU-side engine suites under this machine's transformers"
  python3 -m pytest -q -p no:cacheprovider -m "not gpu" tests/test_llama_runner.py tests/test_models.py \
    tests/test_decoder.py tests/test_methods.py tests/test_runtimes.py tests/test_kernels_launch_spec.py \
    tests/test_step_kernels.py \
    2>&1 | tee "$OUT/cpu_suites.log" | tail -2
fi
if has bench; then
  echo "== bench methods, shipped pair, greedy, bf16 (steady-state decode time)"
  python3 main.py bench methods --device cuda --methods $M --k 4 --prompts 8 --max-new-tokens 128 2>&1 | tee "$OUT/bench_gpu.txt"
  echo "== bench methods, T=0.8"
  python3 main.py bench methods --device cuda --methods $M --k 4 --prompts 8 --max-new-tokens 128 --temperature 0.8 \
    2>&1 | tee -a "$OUT/bench_gpu.txt"
fi
if has runtimes; then
  echo "== bench runtimes, shipped pair (end to end, TTFT apart, HF generate beside)"
  python3 main.py bench runtimes --device cuda --methods $M --k 4 --prompts 8 --max-new-tokens 128 2>&1 \
    | tee "$OUT/runtimes_shipped.txt"
fi
if has synthetic; then
  for shape in ${SHAPES:-llama-1b llama-7b}; do
    echo "== bench runtimes, synthetic $shape (random weights, timing only)"
    python3 main.py bench runtimes --device cuda --synthetic $shape --methods none,draft --k 4 --prompts 4 \
      --max-new-tokens 128 --hf hf-eager,hf-assisted 2>&1 | tee -a "$OUT/runtimes_synthetic.txt"
  done
fi
if has lossless; then
  echo "== check-lossless on CUDA (fp32)"
  for m in draft eagle eagle:8 medusa; do python3 main.py check-lossless --device cuda --dtype float32 --method $m --k 4 \
    --samples 1000 2>&1; done | tee "$OUT/lossless_gpu.txt"
fi
if has kernels; then
  echo "== bench kernels"
  python3 main.py bench kernels 2>&1 | tee "$OUT/bench_kernels.txt"
fi
