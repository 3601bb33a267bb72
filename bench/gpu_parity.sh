#!/bin/bash
# The GPU correctness suite in one device call: `tandem gpu-test` (every op family against the CPU
# oracle in f32 and bf16, the whole decoder, the paged engine, CUDA graphs, rollout/training
# agreement, the HF fixtures, the sharded update) and the communicator checks at world size 1
# through NCCL (`tandem dist-test --device cuda`). For several GPUs see bench/gpu_dist.sh.
# Usage (from the repo root on the GPU machine; D holds the stripped release `tandem`, which
# `make gpu-test` copies to .device/):
#   D=.device bench/gpu_parity.sh            # SEED=3 ONLY=paged TIME=1 optional
set -u
D=${D:-.device}
OUT=${OUT:-/tmp/gpu_parity}
mkdir -p "$OUT"
export TANDEM_CACHE=${TANDEM_CACHE:-/root/tandem-cache} NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
t0=$SECONDS
$D/tandem gpu-test --seed "${SEED:-3}" ${ONLY:+--only "$ONLY"} ${TIME:+--time} --json "$OUT/parity.json" > "$OUT/parity.txt" 2>&1
rc=$?
echo "gpu-test rc=$rc in $((SECONDS - t0)) s: $(tail -1 "$OUT/parity.txt")"
grep ' FAIL' "$OUT/parity.txt" | head -20
$D/tandem dist-test --device cuda > "$OUT/dist_world1.txt" 2>&1
echo "dist-test (world 1, NCCL) rc=$?: $(tail -1 "$OUT/dist_world1.txt")"
echo "done in $((SECONDS - t0)) s"
exit $rc
