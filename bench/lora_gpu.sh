#!/bin/bash
# Issue 37's GPU checks on one lent GPU, in one go (docs/LORA.md, docs/BENCHMARKS.md):
#   1. `tandem gpu-test --only lora` (a LoRA decoder against the CPU) and `--only sharded_update`
#      (its LoRA rows: the adapters alone sharded on a frozen base);
#   2. `tandem bench update` of the random Qwen2.5-7B shape with rank-32 adapters on every
#      projection, 64 prompts x 8 samples x (128 + 512) tokens a step: step time, tok/s, peak;
#   3. bench/gpu_multi.sh's g7bl: whole GRPO-LoRA steps of that shape on one GPU's daemon;
#   4. `tandem bench rollout` of the 1.5B and 7B shapes without adapters, with rank-32 adapters
#      merged (the merge timed) and unmerged (applied at each step): which rollout to keep.
# PARTS [checks update g7bl rollout] picks and orders them (1: checks, 2: update, 3: g7bl,
# 4: rollout). Variables: B the directory of the release binaries [/root/rl/bin]; OUT [/tmp/lora_gpu];
# W the work directory of g7bl [/tmp/lora_gpu_work]. Run from the repository's root (the
# checks read tests/fixtures); pick the GPU with CUDA_VISIBLE_DEVICES.
set -u
B=${B:-/root/rl/bin}
OUT=${OUT:-/tmp/lora_gpu}
W=${W:-/tmp/lora_gpu_work}
mkdir -p "$OUT" "$W"
export NCCL_NVLS_ENABLE=0 TANDEM_CACHE=${TANDEM_CACHE:-/root/tandem-cache}
t0=$SECONDS
checks() {
  for only in lora lora_merge lora_unmerged sharded_update; do
    "$B/tandem" gpu-test --only "$only" --json "$OUT/gpu_test_$only.json" > "$OUT/gpu_test_$only.log" 2>&1
    echo "gpu-test --only $only rc=$? ($((SECONDS - t0)) s): $(grep -E 'checks' "$OUT/gpu_test_$only.log" | tail -1)"
  done
}
update() {
  "$B/tandem" bench update --device cuda --shape qwen7b --lora-rank 32 --lora-alpha 64 \
    --micro-batch 8 --micro-batches 64 --seq-len 640 --prompt-len 128 --warmup 1 --steps 2 \
    --json "$OUT/bench_update_7b_lora.json" > "$OUT/bench_update_7b_lora.log" 2>&1
  echo "bench update 7B LoRA rc=$? ($((SECONDS - t0)) s)"
  tail -6 "$OUT/bench_update_7b_lora.log"
}
g7bl() {
  D=$B OUT=$OUT/g7bl W=$W N=1 PARTS=g7bl G7B_STEPS=${G7B_STEPS:-3} bash bench/gpu_multi.sh > "$OUT/g7bl.log" 2>&1
  echo "g7bl rc=$? ($((SECONDS - t0)) s)"
  tail -12 "$OUT/g7bl.log"
}
# The same cases (256 x 128 + 256 new; GRPO 64 x 8 x ~131 + 512, fixed lengths) without
# adapters, merged and unmerged (rank 32, alpha 64, every projection).
rollout() {
  for m in qwen1.5b qwen7b; do
    for mode in none merged unmerged; do
      local lora=(--lora-rank 32 --lora-alpha 64 --lora-targets all-linear --lora-mode "$mode")
      [ "$mode" = none ] && lora=()
      "$B/tandem" bench rollout --device cuda --model "$m" --modes graphs --runs 2 "${lora[@]}" \
        --batches 256 --prompt-tokens 128 --new-tokens 256 --grpo 64,8,131,512 --fixed-lengths \
        > "$OUT/rollout_${m}_$mode.txt" 2>&1
      echo "bench rollout $m $mode rc=$? ($((SECONDS - t0)) s)"
    done
  done
}
for part in ${PARTS:-checks update g7bl rollout}; do
  case $part in
  checks | update | g7bl | rollout) $part ;;
  *) echo "unknown part $part"; exit 2 ;;
  esac
done
