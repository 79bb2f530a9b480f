# Where an n-gram round's time goes on this GPU's host, beside plain decoding's and Medusa's: the host's
# steps timed (with call counts), the GPU's replayed round alone, and a cProfile of one generation.
# Run on the device from the repository root with OUT set: bash scripts/gpu_ngram_host.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi -L; nproc; lscpu | grep -m1 "Model name"; date
echo "== host steps"; date
timeout 150 python3 scripts/host_cost_probe.py --methods none,ngram,medusa --prompts 8 2>&1 | grep -v Warn | tee $OUT/host_cost_ngram.txt
echo "== GPU round alone"; date
timeout 150 python3 scripts/round_replay_probe.py --methods none,ngram,medusa --passes 1 2>&1 | grep '^{' | tee $OUT/round_replay_ngram.txt
echo "== profile"; date
timeout 200 python3 scripts/profile_e2e.py --synthetic shipped --no-prefill --methods none,ngram --top 30 > $OUT/profile_e2e_ngram.txt 2>&1
grep -E "^==|ms/token" $OUT/profile_e2e_ngram.txt
date
