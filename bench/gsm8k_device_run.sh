#!/bin/bash
# The GRPO run on GSM8K on the lent GPU machine (docs/GSM8K_RUN.md), in calls of < 10 minutes:
#   STEP=setup   unpack the stripped binaries and data carried in $D (bin.tar.xz,
#                train/test.parquet) into $R; start an empty GGUF there and keep the last
#                (short) piece, carried in $P with them, for the end
#   STEP=piece   append the piece carried in $P (`split -b 50M` of the GGUF) to $R/qwen.gguf
#   STEP=bench   `tandem bench grpo-step` on the daemon (random 0.5B shape) and the PyTorch peer
#   STEP=run     check the GGUF's sha256, import it (first time), then run (or resume) the
#                pipeline for at most $SECS seconds and $STEPS steps; copy the run's metrics,
#                eval results (rescored strict and flexible) and logs to $OUT
# The run directory survives between calls while the machine stays warm; a run stopped by the
# time limit resumes (going back to its last optimizer checkpoint when needed).
set -u
D=${D:-.device/rl}
P=${P:-.device/piece}
R=${R:-/root/rl}
export TANDEM_CACHE=/root/tandem-cache TANDEM_BIN_DIR=$R/bin PYTHONUNBUFFERED=1
SPEC=pipelines/gsm8k-qwen2.5-coder-0.5b-cuda.toml
case "$STEP" in
setup)
  rm -rf "$R" && mkdir -p "$R/bin" "$R/data/gsm8k" "$R/pipelines/rewards"
  tar -xJf "$D/bin.tar.xz" -C "$R/bin" && cp "$D"/train.parquet "$D"/test.parquet "$R/data/gsm8k/"
  cp "$D/prompts200.parquet" "$D/peer_grpo_step.py" "$R/"
  cp "$SPEC" "$R/pipelines/" && cp pipelines/rewards/gsm8k_format.py "$R/pipelines/rewards/"
  : > "$R/qwen.gguf"
  cat "$P"/* > "$R/last.piece"
  ls -la "$R" "$R/bin"; nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
  ;;
piece)
  cat "$P"/* >> "$R/qwen.gguf" && ls -la "$R/qwen.gguf"
  ;;
bench)
  cd "$R" || exit 1
  bin/tandem init-model --like qwen2 --layers 24 --hidden 896 --heads 14 --kv-heads 2 --ffn 4864 \
    --vocab 151936 --tie true --rope-theta 1000000 --rms-norm-eps 1e-6 --seed 1 --out /tmp/q05g > /dev/null
  bin/tandem bench grpo-step --device cuda --model /tmp/q05g --prompts prompts200.parquet --raw-prompt \
    --work /tmp/grpo --prompts-per-step 64 --n 8 --max-new-tokens 512 --mini-batches 4 --steps 3 \
    --modes daemon --checkpoint-every 3 > "$OUT/grpo.txt" 2>&1
  echo "bench grpo-step rc=$?"; tail -12 "$OUT/grpo.txt"
  rm -rf /tmp/grpo
  python3 peer_grpo_step.py 64 8 512 > "$OUT/peer_grpo.json" 2> "$OUT/peer_grpo.err"
  echo "peer grpo rc=$?"; cat "$OUT/peer_grpo.json"
  ;;
run)
  cd "$R" || exit 1
  [ "$(stat -c %s qwen.gguf)" = 491400064 ] || cat last.piece >> qwen.gguf
  echo "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32  qwen.gguf" | sha256sum -c || exit 1
  if [ ! -d models/qwen2.5-coder-0.5b ]; then
    bin/tandem import-gguf qwen.gguf --out models/qwen2.5-coder-0.5b || exit 1
  fi
  t0=$SECONDS
  timeout -s INT "${SECS:-480}" bin/pipeline run "$SPEC" --run-dir runs/gsm8k --steps "${STEPS:-100}" \
    >> "$OUT/pipeline.log" 2>&1
  echo "pipeline rc=$? in $((SECONDS - t0)) s"
  # The daemon may still be stopping after an interrupted runner.
  sleep 2; pkill -f "tandem daemon" ; sleep 1
  cp runs/gsm8k/metrics.jsonl runs/gsm8k/eval.jsonl runs/gsm8k/state.json runs/gsm8k/commands.sh "$OUT/" 2>/dev/null
  tail -c 20000 runs/gsm8k/daemon.log > "$OUT/daemon.log.tail" 2>/dev/null
  for d in runs/gsm8k/eval/step-*; do
    s=$(basename "$d")
    [ -f "$d/rollout.parquet" ] || continue
    for m in strict flexible; do
      bin/score --in "$d/rollout.parquet" --out "/tmp/rescored-$m.parquet" --reward gsm8k \
        --gsm8k-method $m --metrics "$OUT/eval-$m-$s.json" > /dev/null 2>&1
    done
    echo "$s strict $(grep -o '"accuracy": *[0-9.e-]*' "$OUT/eval-strict-$s.json" | head -1) flexible $(grep -o '"accuracy": *[0-9.e-]*' "$OUT/eval-flexible-$s.json" | head -1)"
  done
  last=$(ls -d runs/gsm8k/eval/step-* | tail -1)
  cp runs/gsm8k/eval/step-0000/scored.parquet "$OUT/eval-step-0000-scored.parquet" 2>/dev/null
  cp "$last/scored.parquet" "$OUT/eval-last-scored.parquet" 2>/dev/null
  tail -5 "$OUT/pipeline.log"
  ;;
esac
