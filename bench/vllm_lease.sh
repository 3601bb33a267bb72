#!/bin/bash
# tandem against vLLM 0.26 and PyTorch in one lease (issue 35), detached on the device with
# setsid so that the plan outlives the device call that starts it, while later calls carry the
# vLLM bundle's parts (../shared/peers/vllm/README.md: one ~50 MiB part per call).
#   1. first run on a fresh machine: `rollout` (FIRST_SHAPES [0.5b], 256 prompts x 256 new tokens)
#      with an empty kernel cache, then again, for each of BUILDS [base new] (wall time each);
#   2. `tandem bench rollout` on the Qwen2.5 SHAPES [0.5b 1.5b 7b]: batch 64 and 256 x prompt 128
#      x 256 new tokens, and the GRPO shape 128 x n=8 x ~131 prompt x 512 new, fixed lengths;
#      each writes its cases (prompt ids) for the peer;
#   3. `tandem bench update` / `bench logprob` at the 0.5B and 1.5B shapes;
#   4. once the vLLM parts are all in /root/vb: install, then bench/peer_vllm.py on each shape's
#      cases (same prompt ids, ignore_eos);
#   5. bench/peer_update.py (SDPA, torch.compile, fused AdamW, chunked log-prob) at 0.5B and 1.5B.
# PARTS [first rollout update vllm peers] picks and orders them (RBUILDS [new] = `base new`
# also runs step 2 with the base build); also `gputest` (the new build's
# whole `tandem gpu-test`) and `profile` (bench/decode_profile.sh on the 7B shape at 256 rows).
# Carry C [.device/vl] holding bin.tar.xz (new build: tandem, rollout), base.tar.xz (base build:
# tandem, rollout) and prompts.parquet (`tandem prepare gsm8k`).
#   STEP=start bash bench/vllm_lease.sh          unpack, start the plan detached, return
#   STEP=part P=.device/vllm/part0 bash ...      copy one vLLM part to /root/vb
#   STEP=wait SECS=540 bash bench/vllm_lease.sh  wait up to SECS for the plan, print its log,
#                                                pack what it wrote into $OUT/vl.tgz
# G [/root/vl] is where the plan writes (vl.log: one line per part with its exit code).
set -u
STEP=${STEP:-start}
C=${C:-.device/vl}
G=${G:-/root/vl}
B=${B:-/root/vl-bin}
case $STEP in
start)
  rm -rf "$B" "$G" /root/vl-src
  mkdir -p "$B/base" "$G" /root/vl-src /root/vb
  tar -xJf "$C/bin.tar.xz" -C "$B" && tar -xJf "$C/base.tar.xz" -C "$B/base" \
    && cp "$C/prompts.parquet" "$B/" && cp -r bench /root/vl-src/ \
    && mkdir -p /root/vl-src/tests && cp -r tests/fixtures /root/vl-src/tests/ || exit 1
  (cd /root/vl-src && setsid nohup env B="$B" G="$G" STEP=plan bash bench/vllm_lease.sh \
    > "$G/plan.out" 2>&1 < /dev/null &)
  echo "started: $G/vl.log"
  ;;
part)
  # Each file lands under its name whole (the plan counts the part files it sees).
  mkdir -p /root/vb/in && for f in "$P"/*; do
    cp "$f" /root/vb/in/ && mv "/root/vb/in/$(basename "$f")" /root/vb/ || exit 1
  done && ls /root/vb
  ;;
plan)
  export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
  log() { echo "$(date +%T) $*" >> "$G/vl.log"; }
  # First run on a fresh machine: `rollout` with an empty kernel cache, then again (FIRST_SHAPES
  # [0.5b]; each build of BUILDS [base new]).
  first_run() {
    for s in ${FIRST_SHAPES:-0.5b}; do
      init_model "$s" "/tmp/first_$s"
      for build in ${BUILDS:-base new}; do
        rb=$B/rollout
        [ "$build" = base ] && rb=$B/base/rollout
        rm -rf "/root/kc-$build-$s"
        for run in fresh warm; do
          t0=$(date +%s%N)
          TANDEM_CACHE=/root/kc-$build-$s $rb --model "/tmp/first_$s" --in "$B/prompts.parquet" \
            --out /tmp/fr.parquet --device cuda --raw-prompt --n 1 --limit 256 --max-new-tokens 256 \
            --ignore-eos --metrics "$G/first_${build}_${s}_$run.json" > "$G/first_${build}_${s}_$run.log" 2>&1
          log "first-run $s $build $run rc=$? wall $((($(date +%s%N) - t0) / 1000000)) ms"
        done
      done
    done
  }
  init_model() {
    local a
    case $1 in
    0.5b) a="--layers 24 --hidden 896 --heads 14 --kv-heads 2 --ffn 4864 --tie true" ;;
    1.5b) a="--layers 28 --hidden 1536 --heads 12 --kv-heads 2 --ffn 8960 --tie true" ;;
    esac
    # shellcheck disable=SC2086
    "$B/tandem" init-model --like qwen2 $a --vocab 151936 --rope-theta 1000000 --rms-norm-eps 1e-6 \
      --seed 1 --out "$2" > /dev/null
  }
  # RBUILDS [new]: with `base new`, the base build's bench first, into rollout_base_$s.txt.
  tandem_rollout() {
    for s in ${SHAPES:-0.5b 1.5b 7b}; do
      for build in ${RBUILDS:-new}; do
        local tb=$B/tandem out=$G/rollout_$s.txt
        [ "$build" = base ] && tb=$B/base/tandem out=$G/rollout_base_$s.txt
        "$tb" bench rollout --model qwen$s --batches 64,256 --prompt-tokens 128 --new-tokens 256 \
          --grpo 128,8,131,512 --fixed-lengths --max-num-seqs 1024 --modes graphs --runs 2 \
          --cases-out "$G/cases_$s.json" > "$out" 2>&1
        log "bench rollout $s $build rc=$?"
      done
    done
  }
  tandem_update() {
    for s in 0.5b 1.5b; do
      "$B/tandem" bench update --shape qwen$s --json "$G/update_$s.json" > "$G/update_$s.txt" 2>&1
      log "bench update $s rc=$?"
      "$B/tandem" bench logprob --shape qwen$s --json "$G/logprob_$s.json" > "$G/logprob_$s.txt" 2>&1
      log "bench logprob $s rc=$?"
    done
  }
  peer_vllm() {
    local t0=$SECONDS
    until [ "$(ls /root/vb 2> /dev/null | grep -c part)" -ge 3 ] || [ $((SECONDS - t0)) -gt 600 ]; do sleep 3; done
    E=$(bash /root/vb/install_on_device.sh /root/vb 2> "$G/vllm_install.log")
    log "vllm install rc=$? $E"
    eval "$E"
    for s in ${SHAPES:-0.5b 1.5b 7b}; do
      python3 bench/peer_vllm.py "$G/cases_$s.json" 2 > "$G/vllm_$s.txt" 2> "$G/vllm_$s.err"
      log "peer vllm $s rc=$? $(grep -c tokens_per_s "$G/vllm_$s.txt") cases"
    done
  }
  peer_training() {
    for s in 0.5b 1.5b; do
      python3 bench/peer_update.py 3 --shape $s > "$G/peer_update_$s.txt" 2> "$G/peer_update_$s.err"
      log "peer update $s rc=$?"
      python3 bench/peer_update.py 3 --shape $s --logprob > "$G/peer_logprob_$s.txt" 2> "$G/peer_logprob_$s.err"
      log "peer logprob $s rc=$?"
    done
  }
  log "start $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
  python3 -c "import torch; torch.zeros(1).cuda()"  # the driver's own first start, outside the timings
  for part in ${PARTS:-first rollout update vllm peers}; do
    case $part in
    first) first_run ;;
    gputest)
      "$B/tandem" gpu-test --json "$G/gpu_test.json" > "$G/gpu_test.log" 2>&1
      log "gpu-test rc=$? $(grep -E 'checks' "$G/gpu_test.log" | tail -1)" ;;
    profile)
      for r in ${PROFILE_ROWS:-256}; do
        D=$B MODEL=qwen7b ROWS=$r OUT=$G bash bench/decode_profile.sh > "$G/profile_7b_$r.txt" 2>&1
        log "decode profile $r rc=$?"
      done ;;
    rollout) tandem_rollout ;;
    update) tandem_update ;;
    vllm) peer_vllm ;;
    peers) peer_training ;;
    esac
  done
  log done
  ;;
wait)
  t0=$SECONDS
  until grep -q ' done$' "$G/vl.log" 2> /dev/null || [ $((SECONDS - t0)) -ge "${SECS:-540}" ]; do
    sleep 5
  done
  cat "$G/vl.log"
  tar czf "$OUT/vl.tgz" -C "$(dirname "$G")" "$(basename "$G")"
  ;;
esac
