#!/bin/bash
# On a GPU machine: the communicator checks and `bench dist` through NCCL at world size 1 and
# at every world size of 2, 4 and 8 that the machine's GPUs allow (`tandem launch`, one rank per
# GPU). Expects the stripped release `tandem` in $D (make gpu-test copies it to .device/);
# writes logs and JSON under $OUT and prints a short summary last.
#   D=.device bench/gpu_dist.sh            (OUT defaults to /tmp/dist)
#   NS="2" DIST_ARGS="--shapes qwen7b" ...  only these world sizes past 1; extra `bench dist` flags
#   DIST_ARGS_1="..."                       other flags at world size 1 [DIST_ARGS] (there a
#                                           collective is a copy and the bus bandwidth is 0)
set -u
D=${D:-.device}
T=$D/tandem
OUT=${OUT:-/tmp/dist}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
GPUS=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "$GPUS GPU(s)"
SUMMARY=()

# World size 1: real NCCL calls on one rank.
$T dist-test --device cuda --json "$OUT/dist_test_1.json" > "$OUT/dist_test_1.log" 2>&1
rc=$?; SUMMARY+=("dist-test n=1 rc=$rc $(grep -c '^  ok' "$OUT/dist_test_1.log") ok, $(grep -c '^  FAIL' "$OUT/dist_test_1.log") failed")
# shellcheck disable=SC2086
$T bench dist --device cuda --max-size 1GiB ${DIST_ARGS_1-${DIST_ARGS:-}} --json "$OUT/bench_dist_1.json" > "$OUT/bench_dist_1.log" 2>&1
SUMMARY+=("bench dist n=1 rc=$?")

for n in ${NS:-2 4 8}; do
  [ "$n" -le "$GPUS" ] || continue
  $T launch --nproc-per-node $n -- $T dist-test --device cuda --json "$OUT/dist_test_$n.json" \
    > "$OUT/dist_test_$n.log" 2>&1
  rc=$?; SUMMARY+=("dist-test n=$n rc=$rc $(grep -c '^  ok' "$OUT/dist_test_$n.log") ok, $(grep -c '^  FAIL' "$OUT/dist_test_$n.log") failed")
  $T launch --nproc-per-node $n -- $T bench dist --device cuda ${DIST_ARGS:-} --json "$OUT/bench_dist_$n.json" \
    > "$OUT/bench_dist_$n.log" 2>&1
  SUMMARY+=("bench dist n=$n rc=$?")
  # The PyTorch NCCL peer at the same sizes, in the same call (bench/peer_nccl.py).
  if python3 -c "import torch" 2>/dev/null; then
    python3 -m torch.distributed.run --standalone --nproc-per-node $n bench/peer_nccl.py \
      --sizes 64MiB,256MiB,1GiB --json "$OUT/peer_nccl_$n.json" > "$OUT/peer_nccl_$n.log" 2>&1
    SUMMARY+=("torch peer n=$n rc=$?")
  fi
  # A rank killed mid-run: every other rank and the launcher must stop, naming it, in < 60 s.
  start=$(date +%s)
  # Each bounded by 120 s, so a rank that does not stop is reported (rc 124) instead of
  # holding the lease.
  timeout -s KILL 120 $T launch --nproc-per-node $n -- $T dist-test --device cuda --fail-rank 1 --fail-mode kill \
    > "$OUT/kill_$n.log" 2>&1
  rc=$?; SUMMARY+=("kill rank 1, n=$n: rc=$rc after $(( $(date +%s) - start )) s: $(grep -m1 '^error: rank' "$OUT/kill_$n.log")")
  start=$(date +%s)
  timeout -s KILL 120 $T launch --nproc-per-node $n --timeout 10 -- $T dist-test --device cuda --fail-rank 1 \
    --fail-mode hang > "$OUT/hang_$n.log" 2>&1
  rc=$?; SUMMARY+=("hang rank 1, n=$n: rc=$rc after $(( $(date +%s) - start )) s: $(grep -m1 '^error: rank' "$OUT/hang_$n.log")")
done

for f in "$OUT"/bench_dist_*.log "$OUT"/peer_nccl_*.log; do [ -f "$f" ] && { echo "== $f"; grep -v '^{' "$f" | tail -40; }; done
printf '%s\n' "${SUMMARY[@]}"
