#!/bin/bash
# On the GPU machine: the bf16 decoder checks, `update` / `ref-logprob --device cuda` against
# --device cpu on a tiny model, and Qwen2.5-0.5B-shaped log-probs for the transformers
# comparison. Expects the stripped release binaries, the batches of bench/make_batches.py and
# bench/hf_logprob_compare.py in $D; writes everything under $OUT (compare it with
# bench/compare_gpu_outputs.py). The run tool brings back few files: all but the summary go
# into $OUT/results.tgz.
D=${D:-.device/cuda2}
T=$D/tandem
FINAL=$OUT
OUT=/tmp/results
rm -rf $OUT && mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
$T gpu-test --only decoder --seed 11 --json "$OUT/decoder.json" > "$OUT/decoder.txt" 2>&1
echo "gpu-test decoder rc=$?"; grep -E "decoder|checks" "$OUT/decoder.txt"
$T gpu-test --only hf_fixtures --seed 11 > "$OUT/hf.txt" 2>&1
echo "gpu-test hf_fixtures rc=$?"; grep -E "hf fixture|checks" "$OUT/hf.txt"

$T init-model --like qwen2 --layers 2 --hidden 64 --heads 4 --kv-heads 2 --ffn 128 --vocab 300 \
  --seed 6 --out /tmp/tiny > /dev/null
for dev in cpu cuda; do
  $D/update --model /tmp/tiny --in $D/tiny.parquet --out-model "$OUT/upd_$dev" --lr 1e-3 \
    --device $dev --metrics "$OUT/upd_$dev.json" > "$OUT/upd_$dev.log" 2>&1
  echo "update --device $dev rc=$?"
  $D/ref-logprob --model /tmp/tiny --in $D/tiny.parquet --out "$OUT/ref_$dev.parquet" --column ref_logprobs \
    --entropy --device $dev > "$OUT/ref_$dev.log" 2>&1
  echo "ref-logprob --device $dev rc=$?"
done
$D/update --model /tmp/tiny --in $D/tiny.parquet --out-model /tmp/x --device cuda:7 \
  > "$OUT/bad_device.log" 2>&1
echo "update --device cuda:7 rc=$? ($(tail -1 "$OUT/bad_device.log"))"

$T init-model --like qwen2 --layers 24 --hidden 896 --heads 14 --kv-heads 2 --ffn 4864 \
  --vocab 151936 --tie true --rope-theta 1000000 --rms-norm-eps 1e-6 --seed 1 --out /tmp/q05 \
  > /dev/null
/usr/bin/time -v $D/ref-logprob --model /tmp/q05 --in $D/qwen05.parquet \
  --out "$OUT/q05_ours.parquet" --column ref_logprobs --device cuda > "$OUT/q05_ours.log" 2>&1
echo "ref-logprob q05 cuda rc=$?"; grep -E "ref-logprob:|Elapsed" "$OUT/q05_ours.log"
python3 $D/hf_logprob_compare.py /tmp/q05 $D/qwen05.json "$OUT/q05_hf.json" > "$OUT/q05_hf.log" 2>&1
echo "transformers rc=$?"; tail -3 "$OUT/q05_hf.log"

# One update step at the issue-6 workload shape: 64 sequences of 640 tokens, micro-batches of
# 8 sequences (5120 tokens), one optimizer step; GPU memory sampled by nvidia-smi every 100 ms.
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$OUT/mem.log" &
SMI=$!
$D/update --model /tmp/q05 --in $D/train05.parquet --out-model /tmp/q05_upd --lr 1e-6 \
  --micro-batch-tokens 5120 --device cuda --metrics "$OUT/train05.json" > "$OUT/train05.log" 2>&1
echo "update q05 cuda rc=$?"
kill $SMI
grep -E "^update:" "$OUT/train05.log" | tail -3
echo "peak GPU memory used (MiB, whole device): $(sort -n "$OUT/mem.log" | tail -1)"
tar czf "$FINAL/results.tgz" -C "$OUT" .
