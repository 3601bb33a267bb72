#!/bin/bash
# On the GPU machine: `update --device cuda` at the issue-6 workload (Qwen2.5-0.5B shape, random
# weights, 64 x 640-token sequences, micro-batches of 8, PPO-clip, AdamW) for 1 and 4 optimizer
# steps (4 = --ppo-epochs 4, which first scores the batch once for old log-probs), the scoring
# pass alone (ref-logprob), and the PyTorch peer (bench/peer_update.py) in the same call.
# GPU memory is sampled by nvidia-smi every 100 ms (whole device, so it includes the context).
D=${D:-.device/cuda2}
T=$D/tandem
R=/tmp/bench && rm -rf $R && mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
$T init-model --like qwen2 --layers 24 --hidden 896 --heads 14 --kv-heads 2 --ffn 4864 \
  --vocab 151936 --tie true --rope-theta 1000000 --rms-norm-eps 1e-6 --seed 1 --out /tmp/q05 \
  > /dev/null
mem() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$R/$1.mem" & echo $!; }
for e in 1 4; do
  P=$(mem upd$e)
  $D/update --model /tmp/q05 --in $D/train05.parquet --out-model /tmp/u$e --lr 1e-6 --ppo-epochs $e \
    --micro-batch-tokens 5120 --device cuda --metrics "$R/upd$e.json" > "$R/upd$e.log" 2>&1
  echo "update ppo_epochs=$e rc=$? peak MiB $(sort -n $R/upd$e.mem | tail -1)"; kill $P
  grep -E '"(seconds|tokens|tokens_per_s|load_seconds)"' "$R/upd$e.json" | tr -d '\n '; echo
done
P=$(mem score)
$D/ref-logprob --model /tmp/q05 --in $D/train05.parquet --out $R/s.parquet --column ref_logprobs \
  --micro-batch-tokens 5120 --device cuda 2>&1 | tail -1
kill $P
P=$(mem peer)
python3 $D/peer_update.py 3 2> "$R/peer.err" | tee "$R/peer.json"
echo "peer rc=$? peak MiB $(sort -n $R/peer.mem | tail -1)"; kill $P
tail -2 "$R/peer.err"
tar czf "$OUT/bench.tgz" -C $R .
