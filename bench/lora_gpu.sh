#!/bin/bash
# Issue 37's GPU checks on one lent GPU, in one go (docs/LORA.md, docs/BENCHMARKS.md):
#   1. `tandem gpu-test --only lora` (a LoRA decoder against the CPU) and `--only sharded_update`
#      (its LoRA rows: the adapters alone sharded on a frozen base);
#   2. `tandem bench update` of the random Qwen2.5-7B shape with rank-32 adapters on every
#      projection, 64 prompts x 8 samples x (128 + 512) tokens a step: step time, tok/s, peak;
#   3. bench/gpu_multi.sh's g7bl: whole GRPO-LoRA steps of that shape on one GPU's daemon.
# Variables: B the directory of the release binaries [/root/rl/bin]; OUT [/tmp/lora_gpu];
# W the work directory of g7bl [/tmp/lora_gpu_work]. Run from the repository's root (the
# checks read tests/fixtures); pick the GPU with CUDA_VISIBLE_DEVICES.
set -u
B=${B:-/root/rl/bin}
OUT=${OUT:-/tmp/lora_gpu}
W=${W:-/tmp/lora_gpu_work}
mkdir -p "$OUT" "$W"
export NCCL_NVLS_ENABLE=0 TANDEM_CACHE=${TANDEM_CACHE:-/root/tandem-cache}
t0=$SECONDS
for only in lora sharded_update; do
  "$B/tandem" gpu-test --only "$only" --json "$OUT/gpu_test_$only.json" > "$OUT/gpu_test_$only.log" 2>&1
  echo "gpu-test --only $only rc=$? ($((SECONDS - t0)) s): $(grep -E 'checks' "$OUT/gpu_test_$only.log" | tail -1)"
done
"$B/tandem" bench update --device cuda --shape qwen7b --lora-rank 32 --lora-alpha 64 \
  --micro-batch 8 --micro-batches 64 --seq-len 640 --prompt-len 128 --warmup 1 --steps 2 \
  --json "$OUT/bench_update_7b_lora.json" > "$OUT/bench_update_7b_lora.log" 2>&1
echo "bench update 7B LoRA rc=$? ($((SECONDS - t0)) s)"
tail -6 "$OUT/bench_update_7b_lora.log"
D=$B OUT=$OUT/g7bl W=$W N=1 PARTS=g7bl G7B_STEPS=${G7B_STEPS:-3} bash bench/gpu_multi.sh > "$OUT/g7bl.log" 2>&1
echo "g7bl rc=$? ($((SECONDS - t0)) s)"
tail -12 "$OUT/g7bl.log"
