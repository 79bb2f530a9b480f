#!/usr/bin/env bash
# A GPU measurement session in one device call: GPU tests, benches and profiles, most important first (a run
# cut short keeps what came first); run from the repo root, logs to $OUT:
#   OUT=/some/dir PART="tests methods" bash scripts/gpu/session.sh
# PART picks parts (default: tests tests-pdl runtimes methods batch ksweep pdl-ab host, in this order):
#   tests     every GPU test, 10,000 fuzz cases per kernel (programmatic launch on: the default)
#   tests-pdl the engine, drafter and batch GPU tests again with SPECPLAY_PDL=0 (programmatic launch off)
#   engine    the engine, drafter and batch GPU tests alone (the defaults)
#   runtimes  bench runtimes on the synthetic 1B and 7B shapes, HF eager and assisted beside (RUNTIME_SHAPES,
#             RUNTIME_HF pick others; RUNTIME_ENV runs them once per environment setting)
#   methods   bench methods on the shipped pair (each method's c, textbook E/(1+cK) and the share reached)
#   methods-ab  bench methods once per environment setting of AB (AB_METHODS: the methods)
#   methods-k   bench methods at K = MK (default 5) for K_METHODS
#   batch     bench batch on the synthetic llama-8b at B = 1 and 64 (once per setting of BATCH_AB, if set, e.g.
#             BATCH_AB="SPECPLAY_NORM_KERNEL=0 SPECPLAY_NORM_KERNEL=1")
#   ksweep    bench k-sweep of the shipped pair (measured beside predicted)
#   predictions  the K sweep twice greedy and once at T = 0.8
#   pdl-ab    scripts/profiling/profile_e2e.py on the 1B shape with programmatic launch on, then off
#   profile7b scripts/profiling/profile_e2e.py on the 7B shape with programmatic launch off (each kernel's own time)
#   host      scripts/profiling/profile_e2e.py on the shipped pair: where a round's host time goes, per method
#   kernels   the step kernels' GPU tests (KERNEL_FUZZ cases, default 2,000)
#   gemv-tile runtimes with sp_gemv's segment, blocks and grid of TILE_ENV beside the default, then the step
#             kernels' and bf16 engine GPU tests with TILE_ENV (kernels/NOTES.md's next comparison)
#   shipped-runtimes  bench runtimes on the shipped pair (end to end, TTFT apart), specplay methods only
#   batch-profile  scripts/profiling/profile_e2e.py's batched step of 64 on the synthetic llama-8b: its kernels
#   round-graphs  the engine's GPU tests with EAGLE's and the draft model's round graphs on, then bench methods
#             (none,draft,eagle,eagle3,medusa) with them off and on
#   replays   the replays still off by default: the sampled K sweep with sampled chain and plain replays (and
#             SPECPLAY_GEMV_ROWS=8), then bench methods (none,ngram,eagle:8,eagle3:8) with n-gram's and the
#             EAGLE trees' round graphs off and on
# The parts that ran one-off probes (gemv, gap, ttft, round-replay, host-cost, and predictions' calibration
# spread) were removed with those probes: scripts/gpu_session.sh, at tag before-house-cleanup.
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then   # the comment above is the usage
  awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0
fi
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PART=${PART:-tests tests-pdl runtimes methods batch ksweep pdl-ab host}
ENGINE_TESTS="tests/test_engine_gpu.py tests/test_drafters_gpu.py tests/test_batch_gpu.py tests/test_cuda_calls_gpu.py"
has() { [[ " $PART " == *" $1 "* ]]; }
nvidia-smi -L
if has tests; then  # two runs of their own (one took past 400 s): the step kernels' file, then every other
  SPECPLAY_FUZZ_CASES=10000 timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_step_kernels_gpu.py \
    2>&1 | grep -v -E "UserWarning|FutureWarning|DeprecationWarning|warnings.warn" | tee "$OUT/gpu_tests_step.log" | tail -8
  SPECPLAY_FUZZ_CASES=10000 timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
    $(ls tests/*_gpu.py | grep -v test_step_kernels_gpu.py) \
    2>&1 | grep -v -E "UserWarning|FutureWarning|DeprecationWarning|warnings.warn" | tee "$OUT/gpu_tests.log" | tail -8
fi
if has tests-pdl; then
  SPECPLAY_PDL=0 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_engine_gpu.py \
    tests/test_drafters_gpu.py tests/test_batch_gpu.py 2>&1 | grep -v -E "UserWarning|FutureWarning|DeprecationWarning|warnings.warn" | tee "$OUT/gpu_tests_pdl_off.log" | tail -6
fi
if has engine; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rs $ENGINE_TESTS 2>&1 | grep -v -E "UserWarning|FutureWarning|DeprecationWarning|warnings.warn" \
    | tee "$OUT/gpu_tests_engine.log" | tail -6
fi
if has runtimes; then  # RUNTIME_ENV: one run per setting (default: the defaults)
  for setting in ${RUNTIME_ENV:-SPECPLAY_PDL=1}; do
    for shape in ${RUNTIME_SHAPES:-llama-1b llama-7b}; do
      env ${setting//,/ } timeout 90 python3 main.py bench runtimes --device cuda --synthetic $shape --methods none,draft \
        --k 4 --prompts 4 --max-new-tokens 128 --hf ${RUNTIME_HF:-hf-eager,hf-assisted} 2>&1 \
        | grep -v "compiling\|generation_config" | tee -a "$OUT/runtimes_synthetic${RUNTIME_ENV:+_${setting//[^A-Za-z0-9]/_}}.txt" \
        | tail -7
    done
  done
fi
bench_methods() {  # $1: output file under $OUT, $2: methods, $3: K, $4: lines shown; the environment as set
  timeout 150 python3 main.py bench methods --device cuda --methods "$2" --k "$3" --prompts 8 --max-new-tokens 128 \
    2>&1 | grep -v "compiling" | tee "$OUT/$1" | grep -v "^α" | tail -"$4"
}
if has methods; then
  bench_methods bench_gpu.txt none,draft,ngram,suffix,medusa,eagle,eagle:8,eagle3,eagle3:8,lookahead,layerskip 4 13
fi
if has methods-k; then  # bench methods at another K (MK, default 5) for K_METHODS
  bench_methods "bench_gpu_k${MK:-5}.txt" "${K_METHODS:-none,eagle3,eagle3:8}" "${MK:-5}" 5
fi
if has methods-ab; then  # bench methods once per setting of AB (e.g. AB="SPECPLAY_GEMV_ROWS=1 SPECPLAY_GEMV_ROWS=8";
  # a setting of several variables joins them with commas: SPECPLAY_A=0,SPECPLAY_B=0)
  for setting in ${AB:-SPECPLAY_PDL=1}; do
    ( export ${setting//,/ }; bench_methods "bench_gpu_${setting//[^A-Za-z0-9]/_}.txt" \
      "${AB_METHODS:-none,draft,eagle3,medusa}" 4 "${AB_LINES:-6}" )
  done
fi
if has batch; then
  for setting in ${BATCH_AB:-SPECPLAY_PDL=1}; do
    env ${setting//,/ } timeout 80 python3 main.py bench batch --device cuda --synthetic llama-8b --batches 1,64 \
      --method draft --k 4 --ks 4 2>&1 | grep -v "compiling" | tail -12 \
      | tee "$OUT/batch_llama8b${BATCH_AB:+_${setting//[^A-Za-z0-9]/_}}.txt"
  done
fi
if has ksweep; then
  timeout 160 python3 main.py bench k-sweep --device cuda --method draft --ks 1,2,3,4,6,8 --prompts 4 \
    --max-new-tokens 128 2>&1 | grep -v "compiling" | tee "$OUT/ksweep_gpu.txt" | tail -12
fi
if has predictions; then
  for pass in 1 2; do
    timeout 160 python3 main.py bench k-sweep --device cuda --method draft --ks 1,2,3,4,6,8 --prompts 4 \
      --max-new-tokens 128 2>&1 | grep -v "compiling" | tee "$OUT/ksweep_gpu_pass$pass.txt" | tail -11
  done
  timeout 160 python3 main.py bench k-sweep --device cuda --method draft --ks 1,2,3,4,6,8 --prompts 4 \
    --max-new-tokens 128 --temperature 0.8 2>&1 | grep -v "compiling" | tee "$OUT/ksweep_gpu_t08.txt" | tail -11
fi
if has pdl-ab; then
  for pdl in 1 0; do
    SPECPLAY_PDL=$pdl timeout 40 python3 scripts/profiling/profile_e2e.py --synthetic llama-1b --methods none --top 4 2>&1 \
      | grep -v "compiling\|USDT" > "$OUT/e2e_llama-1b_pdl$pdl.txt"; grep "^==\|GPU busy" "$OUT/e2e_llama-1b_pdl$pdl.txt"
  done
fi
if has profile7b; then
  SPECPLAY_PDL=0 timeout 90 python3 scripts/profiling/profile_e2e.py --synthetic llama-7b --no-prefill --methods ${PROFILE_METHODS:-none} \
    --tokens 32 --top 16 2>&1 | grep -v "compiling\|USDT" > "$OUT/e2e_llama-7b_pdl0.txt"; grep "^==\|GPU busy" "$OUT/e2e_llama-7b_pdl0.txt"
fi
if has host; then
  timeout 90 python3 scripts/profiling/profile_e2e.py --synthetic shipped --no-prefill --methods ${HOST_METHODS:-none,draft,ngram,eagle3,medusa,eagle3:8} \
    --top 30 2>&1 | grep -v "compiling\|USDT" > "$OUT/host_shipped.txt"; grep "^==" "$OUT/host_shipped.txt"
fi
if has kernels; then
  SPECPLAY_FUZZ_CASES=${KERNEL_FUZZ:-2000} timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_step_kernels_gpu.py \
    2>&1 | grep -v -E "UserWarning|FutureWarning|DeprecationWarning|warnings.warn" | tee "$OUT/gpu_tests_kernels.log" | tail -4
fi
if has gemv-tile; then  # sp_gemv's 1024-column segment, built for 4 blocks an SM, launched with 2 (kernels/NOTES.md):
  # plain and draft decoding on the 1B and 7B shapes, the default then the setting, then the step kernels' and the
  # bf16 engine GPU tests with the setting
  TILE_ENV=${TILE_ENV:-SPECPLAY_GEMV_TILE=1024,SPECPLAY_GEMV_BLOCKS=4,SPECPLAY_GEMV_GRID=2}
  for setting in SPECPLAY_PDL=1 "$TILE_ENV"; do
    for shape in llama-1b llama-7b; do
      echo "== $setting $shape" >> "$OUT/runtimes_synthetic_gemv_tile.txt"
      env ${setting//,/ } timeout 90 python3 main.py bench runtimes --device cuda --synthetic $shape --methods none,draft \
        --k 4 --prompts 4 --max-new-tokens 128 --hf none 2>&1 | grep -v "compiling\|generation_config" \
        | tee -a "$OUT/runtimes_synthetic_gemv_tile.txt" | tail -3
    done
  done
  env ${TILE_ENV//,/ } SPECPLAY_FUZZ_CASES=${KERNEL_FUZZ:-2000} timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
    tests/test_step_kernels_gpu.py 2>&1 | grep -v -E "UserWarning|FutureWarning|DeprecationWarning|warnings.warn" \
    | tee "$OUT/gpu_tests_step_gemv_tile.log" | tail -4
  env ${TILE_ENV//,/ } timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_engine_gpu.py -k bf16 2>&1 \
    | grep -v -E "UserWarning|FutureWarning|DeprecationWarning|warnings.warn" | tee "$OUT/gpu_tests_engine_gemv_tile.log" | tail -4
fi
if has batch-profile; then
  timeout 120 python3 scripts/profiling/profile_e2e.py --synthetic llama-8b --no-prefill --methods none --tokens 16 --batch 64 \
    --top 24 2>&1 | grep -v "compiling\|USDT" > "$OUT/e2e_batch_llama-8b.txt"; grep "^==\|GPU busy" "$OUT/e2e_batch_llama-8b.txt"
fi
if has shipped-runtimes; then
  timeout 120 python3 main.py bench runtimes --device cuda --methods none,draft,ngram,eagle,eagle3,eagle3:8 --k 4 \
    --prompts 8 --max-new-tokens 128 --hf none 2>&1 | grep -v "compiling" | tee "$OUT/runtimes_shipped.txt" | tail -9
fi
if has replays; then
  SPECPLAY_SAMPLED_ROUND_GRAPHS=1 SPECPLAY_GEMV_ROWS=8 timeout 120 python3 main.py bench k-sweep --device cuda \
    --method draft --ks 1,2,3,4,6,8 --prompts 4 --max-new-tokens 128 --temperature 0.8 2>&1 | grep -v "compiling" \
    | tee "$OUT/ksweep_gpu_t08_sampled_replays.txt" | tail -11
  for on in 0 1; do
    ( export SPECPLAY_NGRAM_ROUND_GRAPHS=$on SPECPLAY_EAGLE_TREE_ROUND_GRAPHS=$on
      bench_methods "bench_gpu_ngram_tree_round_graphs_$on.txt" none,ngram,eagle:8,eagle3:8 4 6 )
  done
fi
if has round-graphs; then
  SPECPLAY_EAGLE_ROUND_GRAPHS=1 SPECPLAY_DRAFT_ROUND_GRAPHS=1 timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu \
    -rs $ENGINE_TESTS 2>&1 | grep -v -E "UserWarning|FutureWarning|DeprecationWarning|warnings.warn" \
    | tee "$OUT/gpu_tests_round_graphs.log" | tail -6
  for on in 0 1; do
    ( export SPECPLAY_EAGLE_ROUND_GRAPHS=$on SPECPLAY_DRAFT_ROUND_GRAPHS=$on
      bench_methods "bench_gpu_chain_round_graphs_$on.txt" none,draft,eagle,eagle3,medusa 4 7 )
  done
fi
