#!/bin/bash
# On the GPU machine: the whole merged tree's checks, in two calls (each under 10 minutes).
#   PART=a: the full parity suite (`tandem gpu-test`), then bench/gpu_rollout_bench.sh
#           (bench rollout + HF generate peer + paged parity + rollout/ref-logprob agreement).
#   PART=b: `tandem bench update|logprob` + peer_update.py, then `tandem bench grpo-step`
#           (in-process vs daemon, files compared) + bench/peer_grpo_step.py.
# Expects stripped release binaries, prompts.parquet and the peer scripts in $D.
D=${D:-.device/lead}
export TANDEM_CACHE=${TANDEM_CACHE:-/root/tandem-cache}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ "$PART" = a ]; then
  t0=$SECONDS
  $D/tandem gpu-test --json "$OUT/parity.json" > "$OUT/parity.txt" 2>&1
  echo "gpu-test rc=$? in $((SECONDS - t0)) s: $(grep -c ' PASS' "$OUT/parity.txt") PASS, $(grep -c ' FAIL' "$OUT/parity.txt") FAIL"
  grep ' FAIL' "$OUT/parity.txt" | head -20
  D=$D bash bench/gpu_rollout_bench.sh
  echo "part a done in $((SECONDS - t0)) s"
else
  t0=$SECONDS
  $D/tandem bench update --device cuda --json "$OUT/update.json" > "$OUT/update.txt" 2>&1
  echo "bench update rc=$?"; tail -4 "$OUT/update.txt"
  $D/tandem bench logprob --device cuda --json "$OUT/logprob.json" > "$OUT/logprob.txt" 2>&1
  echo "bench logprob rc=$?"; tail -3 "$OUT/logprob.txt"
  python3 $D/peer_update.py 3 > "$OUT/peer_update.json" 2> "$OUT/peer_update.err"; echo "peer update rc=$?"; cat "$OUT/peer_update.json"
  $D/tandem init-model --like qwen2 --layers 24 --hidden 896 --heads 14 --kv-heads 2 --ffn 4864 \
    --vocab 151936 --tie true --rope-theta 1000000 --rms-norm-eps 1e-6 --seed 1 --out /tmp/q05g > /dev/null
  $D/tandem bench grpo-step --device cuda --model /tmp/q05g --prompts $D/prompts200.parquet --raw-prompt \
    --work /tmp/grpo --prompts-per-step 64 --n 8 --max-new-tokens 512 --mini-batches 4 --steps 2 \
    > "$OUT/grpo.txt" 2>&1
  echo "bench grpo-step rc=$?"; cat "$OUT/grpo.txt" | tail -30
  for f in $(cd /tmp/grpo/in-process && find . -type f -name '*.parquet' -o -type f -name '*.safetensors' | sort); do
    cmp -s "/tmp/grpo/in-process/$f" "/tmp/grpo/daemon/$f" && echo "same $f" || echo "DIFFERENT $f"
  done | sort | uniq -c -w 4 | head; 
  for f in $(cd /tmp/grpo/in-process && find . -type f | sort); do cmp -s "/tmp/grpo/in-process/$f" "/tmp/grpo/daemon/$f" || echo "differs: $f"; done | head -20
  python3 $D/peer_grpo_step.py 64 8 512 > "$OUT/peer_grpo.json" 2> "$OUT/peer_grpo.err"; echo "peer grpo rc=$?"; cat "$OUT/peer_grpo.json"; tail -3 "$OUT/peer_grpo.err"
  echo "part b done in $((SECONDS - t0)) s"
fi
