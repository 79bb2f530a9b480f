# Why an n-gram round's time jumps between K = 3 and K = 4 on some GPUs: the target's replayed forward by block
# size, n-gram's replayed round on the GPU alone and the host's steps, each at K = 3 and 4.
# Run on the device from the repository root with OUT set: bash scripts/gpu_ngram_k.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi -L; date
# On a fresh machine the CUDA kernels compile first (cached on disk after); run with short timeouts, every probe
# of this script ran out of time on one such machine and returned nothing, so one short generation compiles
# them first
echo "== compile"
timeout 240 python3 main.py bench methods --device cuda --methods none,ngram --k 4 --prompts 1 --max-new-tokens 8 2>&1 | tail -2
echo "== forward by block size"
timeout 60 python3 scripts/step_timing.py --sizes 1,2,3,4,5,6,7,9 2>&1 | grep -v Warn | tee $OUT/step_timing_sizes.txt
echo "== replayed n-gram round, GPU alone"
for k in 3 4; do timeout 40 python3 scripts/round_replay_probe.py --methods ngram --k $k --passes 1 2>&1 | grep '^{' | sed "s/^{/{\"k\": $k, /"; done | tee $OUT/round_replay_ngram_k.txt
echo "== host steps"
for k in 3 4; do timeout 40 python3 scripts/host_cost_probe.py --methods ngram --prompts 8 --k $k 2>&1 | grep '"method"'; done | tee $OUT/host_cost_ngram_k.txt
date
