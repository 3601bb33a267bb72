#!/bin/bash
# On the GPU machine (issue 7): `tandem bench rollout` and its HF `generate` peer in the same
# run, the paged parity checks, greedy rollout cuda vs cpu on a tiny model, and the
# rollout/ref-logprob agreement on the Qwen2.5-0.5B shape (default kernels, then the training
# forward forced onto the scalar attention kernels). Expects the stripped release binaries,
# prompts.parquet and peer_generate.py in $D; small files under $OUT, parquet files in
# $OUT/results.tgz (compare with bench/compare_rollouts.py).
D=${D:-.device/gpuroll}
export TANDEM_CACHE=${TANDEM_CACHE:-/root/tandem-cache}
R=/tmp/results; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$D/tandem gpu-test --only paged --seed 3 --json "$OUT/paged.json" > "$OUT/paged.txt" 2>&1
echo "gpu-test paged rc=$?"; grep -E "paged|checks" "$OUT/paged.txt" | grep -v "done in"
$D/tandem gpu-test --only sample --seed 3 --json "$OUT/sample.json" > "$OUT/sample.txt" 2>&1
echo "gpu-test sample rc=$?"; grep -E "^sample|checks" "$OUT/sample.txt"
$D/tandem bench rollout --device cuda > "$OUT/bench.txt" 2>&1
echo "bench rollout rc=$?"; tail -6 "$OUT/bench.txt"
python3 $D/peer_generate.py > "$OUT/peer.txt" 2>&1
echo "peer rc=$?"; tail -3 "$OUT/peer.txt"
$D/tandem init-model --like qwen2 --layers 2 --hidden 128 --heads 4 --kv-heads 2 --ffn 384 \
  --vocab 512 --seed 6 --out /tmp/tiny > /dev/null
for dev in cpu cuda; do
  $D/rollout --model /tmp/tiny --in $D/prompts.parquet --out "$R/tiny_greedy_$dev.parquet" \
    --raw-prompt --n 4 --temperature 0 --max-new-tokens 64 --device $dev > "$R/tiny_greedy_$dev.log" 2>&1
  echo "rollout tiny greedy --device $dev rc=$?"
done
$D/tandem init-model --like qwen2 --layers 24 --hidden 896 --heads 14 --kv-heads 2 --ffn 4864 \
  --vocab 151936 --tie true --rope-theta 1000000 --rms-norm-eps 1e-6 --seed 1 --out /tmp/q05 > /dev/null
$D/rollout --model /tmp/q05 --in $D/prompts.parquet --out /tmp/q05_roll.parquet --raw-prompt \
  --n 8 --temperature 1 --max-new-tokens 128 --device cuda --metrics "$OUT/q05_roll.json" > "$R/q05_roll.log" 2>&1
echo "rollout q05 rc=$?"; tail -1 "$R/q05_roll.log"
grep -E '"device_free|kv_pool_bytes|"kv_blocks"' "$OUT/q05_roll.json"
$D/ref-logprob --model /tmp/q05 --in /tmp/q05_roll.parquet --out "$R/q05_agree.parquet" \
  --column old_logprobs --device cuda > "$R/q05_ref.log" 2>&1
echo "ref-logprob q05 rc=$?"
TANDEM_ATTN_SCALAR=1 $D/ref-logprob --model /tmp/q05 --in /tmp/q05_roll.parquet \
  --out "$R/q05_agree_scalar.parquet" --column old_logprobs --device cuda > "$R/q05_ref_scalar.log" 2>&1
echo "ref-logprob q05 scalar attention rc=$?"
tar czf "$OUT/results.tgz" -C $R .
