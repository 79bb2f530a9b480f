# The GPU checks of Medusa's tree chosen every round (`medusa`) beside its fixed tree (`medusa-fixed`): a bench,
# every GPU test, lossless, where a round's time goes (both trees), a second bench, T = 0.8, then n-gram's K sweep
# (its from-run column replayed exactly on the GPU); the checks first.
# Run on the device from the repository root with OUT set: bash scripts/gpu_medusa_chosen_tree.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi -L; date
echo "== bench greedy"; date
timeout 180 python3 main.py bench methods --device cuda --methods all --k 4 --prompts 8 --max-new-tokens 128 2>&1 | tee $OUT/bench_gpu_medusa_trees.txt | grep -v Warn | tail -16
echo "== GPU tests"; date
SPECPLAY_FUZZ_CASES=2000 timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rs $(ls tests/*_gpu.py) tests/test_timing.py > $OUT/gpu_tests_medusa_trees.log 2>&1; echo "tests rc $?" >> $OUT/gpu_tests_medusa_trees.log
tail -4 $OUT/gpu_tests_medusa_trees.log; grep -E "^FAILED|^ERROR" $OUT/gpu_tests_medusa_trees.log | head
echo "== lossless"; date
for m in medusa medusa-fixed; do
  timeout 60 python3 main.py check-lossless --device cuda --dtype float32 --method $m --k 4 --samples 1000 2>&1 | tee $OUT/gpu_lossless_$m.txt | tail -2
done
echo "== where a round's time goes, both trees"; date
timeout 150 python3 scripts/medusa_tree_probe.py > $OUT/medusa_tree_probe.txt 2>&1; grep '^{' $OUT/medusa_tree_probe.txt
echo "== bench both trees again"; date
timeout 90 python3 main.py bench methods --device cuda --methods none,medusa,medusa-fixed,medusa:16,medusa-fixed:16 --k 4 --prompts 8 --max-new-tokens 128 2>&1 | tee $OUT/bench_gpu_medusa_trees_again.txt | grep -v Warn | tail -7
echo "== bench T=0.8"; date
timeout 60 python3 main.py bench methods --device cuda --methods none,medusa,medusa-fixed --k 4 --prompts 8 --max-new-tokens 128 --temperature 0.8 2>&1 | tee $OUT/bench_gpu_medusa_trees_t08.txt | grep -v Warn | tail -5
echo "== n-gram K sweep (from-run column replayed)"; date
timeout 120 python3 main.py bench k-sweep --device cuda --method ngram --ks 1,2,3,4,6,8 --prompts 4 --max-new-tokens 128 2>&1 | tee $OUT/ksweep_gpu_ngram_replayed.txt | grep -v Warn | tail -12
date
