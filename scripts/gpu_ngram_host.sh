# One GPU call: every method's bench, every GPU test, then where an n-gram round's time goes on this host
# beside plain decoding's (the host's steps timed with call counts and longest calls; a cProfile of one
# generation). Run on the device from the repository root with OUT set: bash scripts/gpu_ngram_host.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi -L; nproc; lscpu | grep -m1 "Model name"; date
echo "== bench greedy"; date
timeout 150 python3 main.py bench methods --device cuda --methods all --k 4 --prompts 8 --max-new-tokens 128 2>&1 | grep -v Warn | tee $OUT/bench_methods_all.txt | tail -15
echo "== GPU tests"; date
SPECPLAY_FUZZ_CASES=2000 timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rs $(ls tests/*_gpu.py) tests/test_timing.py > $OUT/gpu_tests.log 2>&1; echo "tests rc $?" >> $OUT/gpu_tests.log
tail -3 $OUT/gpu_tests.log; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.log | head
echo "== host steps"; date
timeout 90 python3 scripts/host_cost_probe.py --methods none,ngram --prompts 8 2>&1 | grep -v Warn | tee $OUT/host_cost_ngram.txt
echo "== profile"; date
timeout 80 python3 scripts/profile_e2e.py --synthetic shipped --no-prefill --methods none,ngram --top 30 > $OUT/profile_e2e_ngram.txt 2>&1
grep -E "^==|ms/token" $OUT/profile_e2e_ngram.txt
date
