#!/bin/bash
# Where a decode step's time goes, kernel by kernel (issue 35): Nsight Compute times every kernel
# of `tandem bench rollout` with eager steps (each kernel its own launch; a graph replays the same
# kernels) on one shape, and bench/decode_profile.py sums the kernels of the decode steps by name.
#   D=DIR MODEL=qwen7b ROWS=256 OUT=DIR bash bench/decode_profile.sh
# D holds the release `tandem`; COUNT [6000] kernels are timed from the process start (enough for
# the case's decode steps after the weight upload and the warm-up case).
set -u
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 2; }
"$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
  --launch-count "${COUNT:-6000}" "$D/tandem" bench rollout --model "${MODEL:-qwen7b}" \
  --batches "${ROWS:-256}" --new-tokens 8 --skip-grpo --modes eager --runs 1 \
  > "$OUT/ncu_${MODEL:-qwen7b}_${ROWS:-256}.csv" 2> "$OUT/ncu_${MODEL:-qwen7b}_${ROWS:-256}.err"
echo "ncu rc=$?"
python3 "$(dirname "$0")/decode_profile.py" "$OUT/ncu_${MODEL:-qwen7b}_${ROWS:-256}.csv"
