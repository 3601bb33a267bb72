#!/bin/bash
# One device round of helper perf (run from the repo root; binaries and scripts in $D): the whole
# parity suite, bench/bench_update.sh (ours vs the peer; VARIANTS=1 adds the host-loss and
# 110-row-chunk variants), and the precision experiment (ref-logprob on the Qwen2.5-0.5B-shaped
# random model vs the transformers set-ups of bench/hf_precision.py; compare here with
# bench/compare_precision.py). Needs in $D: tandem, ref-logprob, peer_update.py,
# bench_update.sh, hf_precision.py, qwen05.parquet and qwen05.json (bench/make_batches.py).
D=${D:-.device/perf}
export TANDEM_CACHE=/root/tandem-cache
set -o pipefail
$D/tandem gpu-test > $OUT/parity_all.log 2>&1
echo "gpu-test (all): rc=$? $(tail -1 $OUT/parity_all.log)"
grep -E ' FAIL' $OUT/parity_all.log | head
R=/tmp/bench D=$D bash $D/bench_update.sh 2>&1 | tee $OUT/bench.log
tar czf $OUT/bench.tgz -C /tmp/bench .
$D/tandem init-model --like qwen2 --layers 24 --hidden 896 --heads 14 --kv-heads 2 --ffn 4864 \
  --vocab 151936 --tie true --rope-theta 1000000 --rms-norm-eps 1e-6 --seed 1 --out /tmp/q05p \
  --force > /dev/null
$D/ref-logprob --model /tmp/q05p --in $D/qwen05.parquet --out $OUT/q05_ours.parquet \
  --column ref_logprobs --device cuda > $OUT/q05_ours.log 2>&1
echo "ref-logprob rc=$?"
python3 $D/hf_precision.py /tmp/q05p $D/qwen05.json $OUT/q05_hf.json > $OUT/q05_hf.log 2>&1
echo "hf_precision rc=$?"
