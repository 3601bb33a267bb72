#!/bin/bash
# On the GPU machine (issue 7), one call: the parity suite; `tandem bench rollout` (each case 3
# runs in one process, default kernels; 2 runs batch-invariant) and the HF `generate` peer in
# the same call; greedy `rollout` cuda vs cpu on a tiny model; the agreement of rollout_logprobs
# with `ref-logprob --column old_logprobs` on the Qwen2.5-0.5B shape (200 GSM8K prompts x 8,
# 128 new tokens), default and batch-invariant. Expects in $D the stripped release binaries
# (tandem, rollout, ref-logprob), prompts.parquet (`tandem prepare gsm8k`, test split) and
# peer_generate.py. Logs under $OUT; parquet files in $OUT/results.tgz (compare them with
# bench/compare_rollouts.py).
D=${D:-.device/lead}
export TANDEM_CACHE=${TANDEM_CACHE:-/root/tandem-cache}
export PYTHONUNBUFFERED=1
R=/tmp/results; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
t0=$SECONDS
$D/tandem gpu-test --seed 3 --json "$OUT/parity.json" > "$OUT/parity.txt" 2>&1
echo "gpu-test rc=$? in $((SECONDS - t0)) s: $(tail -1 "$OUT/parity.txt")"
grep ' FAIL' "$OUT/parity.txt" | head -20
$D/tandem bench rollout --device cuda --modes graphs --runs 3 > "$OUT/bench.txt" 2>&1
echo "bench rollout rc=$?"; grep -A10 '^ *case' "$OUT/bench.txt" | cut -c1-200
grep -o '"ms":[0-9.]*,"part":"[^"]*"' "$OUT/bench.txt"
TANDEM_BATCH_INVARIANT=1 $D/tandem bench rollout --device cuda --modes graphs --runs 2 > "$OUT/bench_inv.txt" 2>&1
echo "bench rollout (batch-invariant) rc=$?"; grep -A7 '^ *case' "$OUT/bench_inv.txt" | cut -c1-200
python3 $D/peer_generate.py > "$OUT/peer.txt" 2>&1
echo "peer rc=$?"; grep "HF generate" "$OUT/peer.txt"
$D/tandem init-model --like qwen2 --layers 2 --hidden 128 --heads 4 --kv-heads 2 --ffn 384 \
  --vocab 512 --seed 6 --out /tmp/tiny > /dev/null
for dev in cpu cuda; do
  $D/rollout --model /tmp/tiny --in $D/prompts.parquet --limit 200 --out "$R/tiny_greedy_$dev.parquet" \
    --raw-prompt --n 4 --temperature 0 --max-new-tokens 64 --device $dev > "$R/tiny_greedy_$dev.log" 2>&1
  echo "rollout tiny greedy --device $dev rc=$?"
done
$D/tandem init-model --like qwen2 --layers 24 --hidden 896 --heads 14 --kv-heads 2 --ffn 4864 \
  --vocab 151936 --tie true --rope-theta 1000000 --rms-norm-eps 1e-6 --seed 1 --out /tmp/q05 > /dev/null
for mode in q05 q05_inv; do
  # Any value of TANDEM_BATCH_INVARIANT turns the mode on: unset it for the default kernels.
  if [ $mode = q05_inv ]; then export TANDEM_BATCH_INVARIANT=1; else unset TANDEM_BATCH_INVARIANT; fi
  $D/rollout --model /tmp/q05 --in $D/prompts.parquet --limit 200 \
    --out /tmp/${mode}_roll.parquet --raw-prompt --n 8 --temperature 1 --max-new-tokens 128 \
    --device cuda --metrics "$OUT/${mode}_roll.json" > "$R/${mode}_roll.log" 2>&1
  echo "rollout $mode rc=$? $(tail -1 "$R/${mode}_roll.log")"
  $D/ref-logprob --model /tmp/q05 --in /tmp/${mode}_roll.parquet \
    --out "$R/${mode}_agree.parquet" --column old_logprobs --device cuda > "$R/${mode}_ref.log" 2>&1
  echo "ref-logprob $mode rc=$?"
done
unset TANDEM_BATCH_INVARIANT
grep -E '"device_free|kv_pool_bytes|overlapped_steps|overlap_discarded' "$OUT/q05_roll.json"
tar czf "$OUT/results.tgz" -C $R .
echo "done in $((SECONDS - t0)) s"
