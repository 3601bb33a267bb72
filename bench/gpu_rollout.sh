#!/bin/bash
# On the GPU machine (issue 7): parity of the paged engine's ops and of the engine itself
# (gpu-test --only paged / sample), then `rollout` on --device cuda vs --device cpu on a tiny
# random model (greedy), and the agreement of rollout_logprobs with `ref-logprob --column
# old_logprobs` on the same weights (tiny and Qwen2.5-0.5B shape). Expects the stripped
# release binaries and prompts.parquet in $D; writes under $OUT (compare the parquet files
# with bench/compare_rollouts.py).
D=${D:-.device/gpuroll}
export TANDEM_CACHE=${TANDEM_CACHE:-/root/tandem-cache}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$D/tandem gpu-test --only paged --seed 3 > "$OUT/paged.txt" 2>&1
echo "gpu-test paged rc=$?"; grep -E "paged|checks" "$OUT/paged.txt" | grep -v "done in"
$D/tandem gpu-test --only sample --seed 3 > "$OUT/sample.txt" 2>&1
echo "gpu-test sample rc=$?"; grep -E "sample|checks" "$OUT/sample.txt" | grep -v "done in"

$D/tandem init-model --like qwen2 --layers 2 --hidden 128 --heads 4 --kv-heads 2 --ffn 384 \
  --vocab 512 --seed 6 --out /tmp/tiny > /dev/null
for dev in cpu cuda; do
  $D/rollout --model /tmp/tiny --in $D/prompts.parquet --out "$OUT/tiny_greedy_$dev.parquet" \
    --raw-prompt --n 4 --temperature 0 --max-new-tokens 64 --device $dev \
    --metrics "$OUT/tiny_greedy_$dev.json" > "$OUT/tiny_greedy_$dev.log" 2>&1
  echo "rollout tiny greedy --device $dev rc=$?"; tail -1 "$OUT/tiny_greedy_$dev.log"
done
# Sampled rollout, then the trainer's log-probs of the same tokens on the GPU.
for m in tiny q05; do
  if [ $m = q05 ]; then
    $D/tandem init-model --like qwen2 --layers 24 --hidden 896 --heads 14 --kv-heads 2 --ffn 4864 \
      --vocab 151936 --tie true --rope-theta 1000000 --rms-norm-eps 1e-6 --seed 1 --out /tmp/q05 > /dev/null
  fi
  $D/rollout --model /tmp/$m --in $D/prompts.parquet --out /tmp/${m}_roll.parquet --raw-prompt \
    --n 8 --temperature 1 --max-new-tokens 128 --device cuda --metrics "$OUT/${m}_roll.json" \
    > "$OUT/${m}_roll.log" 2>&1
  echo "rollout $m T=1 cuda rc=$?"; tail -1 "$OUT/${m}_roll.log"
  $D/ref-logprob --model /tmp/$m --in /tmp/${m}_roll.parquet --out "$OUT/${m}_agree.parquet" \
    --column old_logprobs --device cuda > "$OUT/${m}_ref.log" 2>&1
  echo "ref-logprob $m cuda rc=$?"; tail -1 "$OUT/${m}_ref.log"
done
grep -h '"device_free\|kv_pool_bytes\|kv_blocks"\|preemptions\|tokens_per_s' "$OUT"/q05_roll.json
