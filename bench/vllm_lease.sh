#!/bin/bash
# tandem against vLLM 0.26 and PyTorch in one lease (issue 35), detached on the device with
# setsid so that the plan outlives the device call that starts it, while later calls carry the
# vLLM bundle's parts (../shared/peers/vllm/README.md: one ~50 MiB part per call).
#   1. first run on a fresh machine: `rollout` (FIRST_SHAPES [0.5b], 256 prompts x 256 new tokens)
#      with an empty kernel cache, then again, for each of BUILDS [base new] (wall time each);
#   2. `tandem bench rollout` on the Qwen2.5 SHAPES [0.5b 1.5b 7b] (14b too): batch 64 and 256 x
#      prompt 128 x 256 new tokens, and the GRPO shape 128 x n=8 x ~131 prompt x 512 new (14b:
#      64 x n=8, since 128 x 8 samples' keys and values at 643 tokens, 138.5 GB, and the 29.5 GB
#      of weights do not fit one H200; vLLM at GPU_UTIL 0.85 keeps ~85 GiB for keys and values,
#      ~460k tokens at the 14B's 192 KiB a token: 64 x 8 fits whole, 128 x 8 would not),
#      fixed lengths; each writes its cases (prompt ids) for the peer;
#   3. `tandem bench update` / `bench logprob` at the 0.5B and 1.5B shapes;
#   4. once the vLLM parts are all in /root/vb: install, then bench/peer_vllm.py on each shape's
#      cases (same prompt ids, ignore_eos; VSHAPES [SHAPES] names them);
#   5. bench/peer_update.py (SDPA, torch.compile, fused AdamW, chunked log-prob) at 0.5B and 1.5B.
# PARTS [first rollout update vllm peers] picks and orders them (RBUILDS [new] = `base new`
# also runs step 2 with the base build); also `gputest` (the new build's
# whole `tandem gpu-test`; `gputest-NAME` only the checks named with NAME), `profile` (bench/decode_profile.sh on the 7B shape at 256 rows),
# `attnprof` (ncu's full set of one 7B decode attention kernel, per instruction; see attn_profile) and
# `real`: a real model with EOS on, both engines: `bench rollout --model REAL_MODEL --prompts
# REAL_PROMPTS [$B/prompts.parquet]` on REAL_LIMIT [256] prompts (chat template) x n of REAL_N
# [8,1] (one case each) x up to REAL_NEW [1024] new tokens, tokens/s and length distribution,
# then peer_vllm.py on the same prompt ids and EOS ids (waits up to 600 s for the vLLM parts).
# REAL_MODEL [/root/rl/models/qwen2.5-coder-1.5b] is what `bench/gsm8k_run.sh STEP=import
# MODEL=1.5b` makes (Qwen2.5-Coder-1.5B-Instruct); `real` waits up to REAL_WAIT [900] s for it,
# so the GGUF's pieces can travel in calls after STEP=start.
# peer_vllm.py gives vLLM's requests no seed of their own (REQUEST_SEED unset: its sampler then
# draws the whole batch at once); SEEDED_TOO=1 also runs every case with one (REQUEST_SEED=0,
# as the earlier leases did), into vllm_X_seeded.txt.
# GPU=N runs the plan on GPU N alone (CUDA_VISIBLE_DEVICES), so other GPUs of the machine can
# run other work meanwhile (e.g. gsm8k_run.sh with GPU=M; two plans at once need their own G, B
# and SRC).
# Carry C [.device/vl] holding bin.tar.xz (new build: tandem, rollout), base.tar.xz (base build:
# tandem, rollout; optional) and prompts.parquet (`tandem prepare gsm8k`; PROMPTS_IN names
# another file: with C=.device/rl, gsm8k_run.sh's carry, PROMPTS_IN=.device/rl/test.parquet).
#   STEP=start bash bench/vllm_lease.sh          unpack, start the plan detached, return
#   STEP=part P=.device/vllm/part0 bash ...      copy one vLLM part to /root/vb
#   STEP=wait SECS=540 bash bench/vllm_lease.sh  wait up to SECS for the plan, print its log and
#                                                a summary (every rollout case: tandem and vLLM
#                                                tok/s, ratio, lengths), and put vl.tgz (the
#                                                plan's files, each cut to its last 2 MiB) and
#                                                summary.txt in $OUT
# G [/root/vl] is where the plan writes (vl.log: one line per part with its exit code).
# A dry run on the CPU (no GPU, no vLLM: peer_vllm.py --check prints what it would run):
#   DEVICE=cpu SHAPES=small RBENCH="--batches 4 --prompt-tokens 8 --new-tokens 8 --grpo 2,2,8,8"
#   REAL_MODEL=DIR REAL_LIMIT=4 REAL_N=2 REAL_NEW=32 PARTS="rollout real vllm" G=/tmp/vl
#   B=/tmp/vl-bin VB=/tmp/vb SRC=/tmp/vl-src C=DIR STEP=start bash bench/vllm_lease.sh; then
#   G=/tmp/vl OUT=DIR STEP=wait bash bench/vllm_lease.sh
set -u
STEP=${STEP:-start}
C=${C:-.device/vl}
G=${G:-/root/vl}
B=${B:-/root/vl-bin}
VB=${VB:-/root/vb}
SRC=${SRC:-/root/vl-src}
DEVICE=${DEVICE:-cuda}
# Decode steps as CUDA graphs; the CPU has none (its dry run steps eagerly).
MODES=graphs
[ "$DEVICE" = cpu ] && MODES=eager
[ -n "${GPU:-}" ] && export CUDA_VISIBLE_DEVICES=$GPU
case $STEP in
start)
  rm -rf "$B" "$G" "$SRC"
  mkdir -p "$B/base" "$G" "$SRC" "$VB"
  tar -xJf "$C/bin.tar.xz" -C "$B" && cp "${PROMPTS_IN:-$C/prompts.parquet}" "$B/prompts.parquet" \
    && cp -r bench "$SRC/" \
    && mkdir -p "$SRC/tests" && cp -r tests/fixtures "$SRC/tests/" || exit 1
  if [ -f "$C/base.tar.xz" ]; then tar -xJf "$C/base.tar.xz" -C "$B/base" || exit 1; fi
  # OLDK [.device/oldk]: another checkout's src/lib/backend (kernel sources) for RVARIANTS.
  if [ -d "${OLDK:-.device/oldk}" ]; then rm -rf /root/oldk && cp -r "${OLDK:-.device/oldk}" /root/oldk; fi
  (cd "$SRC" && setsid nohup env B="$B" G="$G" VB="$VB" STEP=plan bash bench/vllm_lease.sh \
    > "$G/plan.out" 2>&1 < /dev/null &)
  echo "started: $G/vl.log${GPU:+ (GPU $GPU)}"
  ;;
part)
  # Each file lands under its name whole (the plan counts the part files it sees).
  mkdir -p "$VB/in" && for f in "$P"/*; do
    cp "$f" "$VB/in/" && mv "$VB/in/$(basename "$f")" "$VB/" || exit 1
  done && ls "$VB"
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
            --out /tmp/fr.parquet --device "$DEVICE" --raw-prompt --n 1 --limit 256 --max-new-tokens 256 \
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
  # The cases of a shape (RBENCH replaces them): the 14B shape's GRPO case is 64 x 8, the
  # largest that fits next to its weights (see the header).
  shape_cases() {
    if [ -n "${RBENCH:-}" ]; then echo "$RBENCH"; return; fi
    local grpo=128,8,131,512
    [ "$1" = 14b ] && grpo=64,8,131,512
    echo "--batches 64,256 --prompt-tokens 128 --new-tokens 256 --grpo $grpo"
  }
  # RBUILDS [new]: with `base new`, the base build's bench first, into rollout_base_$s.txt.
  tandem_rollout() {
    for s in ${SHAPES:-0.5b 1.5b 7b}; do
      local m=qwen$s
      [ "$s" = small ] && m=small
      for build in ${RBUILDS:-new}; do
        local tb=$B/tandem out=$G/rollout_$s.txt
        [ "$build" = base ] && tb=$B/base/tandem out=$G/rollout_base_$s.txt
        # shellcheck disable=SC2046
        "$tb" bench rollout --device "$DEVICE" --model $m $(shape_cases "$s") --fixed-lengths \
          --max-num-seqs 1024 --modes $MODES --runs 2 --cases-out "$G/cases_$s.json" > "$out" 2>&1
        log "bench rollout $s $build rc=$?"
      done
      # RVARIANTS ["NAME:VAR=VAL,VAR=VAL ..."]: the new build again with those variables, into
      # rollout_${s}_NAME.txt: `tune:TANDEM_GEMM_TUNE=verbose` (cuBLASLt candidates timed), or
      # `oldk:TANDEM_KERNEL_SRC=/root/oldk` (the kernels of another checkout, same binary).
      for v in ${RVARIANTS:-}; do
        local name=${v%%:*} envs=${v#*:}
        # shellcheck disable=SC2046,SC2086
        env ${envs//,/ } "$B/tandem" bench rollout --device "$DEVICE" --model $m $(shape_cases "$s") \
          --fixed-lengths --max-num-seqs 1024 --modes $MODES --runs 2 > "$G/rollout_${s}_$name.txt" 2>&1
        log "bench rollout $s $name rc=$?"
      done
    done
  }
  # Nsight Compute's full set, with per-instruction source counters, of one 7B decode attention
  # kernel at 256 rows and context ~260 (ATTN_VARIANTS ["new"]: NAME[:VAR=VAL,...] as above):
  # attn_NAME_details.csv (sections) and attn_NAME_sass.csv (SASS with executed instructions
  # and stall samples per line).
  attn_profile() {
    local ncu
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -1)
    [ -n "$ncu" ] || { log "attn profile: no ncu"; return 1; }
    for v in ${ATTN_VARIANTS:-new}; do
      local name=${v%%:*} envs=
      [ "$v" != "$name" ] && envs=${v#*:}
      # shellcheck disable=SC2086
      env ${envs//,/ } "$ncu" --set full --kernel-name regex:paged_attn_mma --launch-skip 300 --launch-count 1 \
        -f -o "$G/attn_$name" "$B/tandem" bench rollout --device "$DEVICE" --model qwen7b --batches 256 \
        --prompt-tokens 256 --new-tokens 16 --skip-grpo --modes eager --runs 1 > "$G/attn_$name.log" 2>&1
      log "attn profile $name rc=$?"
      "$ncu" -i "$G/attn_$name.ncu-rep" --page details --csv > "$G/attn_${name}_details.csv" 2>&1
      "$ncu" -i "$G/attn_$name.ncu-rep" --page source --csv --print-source sass > "$G/attn_${name}_sass.csv" 2>&1
      rm -f "$G/attn_$name.ncu-rep"
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
  # vLLM from its parts in $VB (installed once; waits up to 600 s for the parts); without a GPU
  # (DEVICE=cpu) peer_vllm.py --check stands for it.
  vllm_env() {
    [ "$DEVICE" = cpu ] && return 0
    [ -n "${VLLM_READY:-}" ] && return 0
    local t0=$SECONDS
    until [ "$(ls "$VB" 2> /dev/null | grep -c part)" -ge 3 ] || [ $((SECONDS - t0)) -gt 600 ]; do sleep 3; done
    E=$(bash "$VB/install_on_device.sh" "$VB" 2> "$G/vllm_install.log")
    log "vllm install rc=$? $E"
    eval "$E"
    VLLM_READY=1
  }
  # peer_vllm.py on one cases file into vllm_$1.txt.
  # peer_on NAME: peer_vllm.py on cases_NAME.json into vllm_NAME.txt; with SEEDED_TOO=1 again
  # with a seed per request (REQUEST_SEED=0, how the rows before 2026-11-28 evening ran) into
  # vllm_NAME_seeded.txt.
  peer_on() {
    if [ "$DEVICE" = cpu ]; then
      python3 bench/peer_vllm.py --check "$G/cases_$1.json" > "$G/vllm_$1.txt" 2> "$G/vllm_$1.err"
    else
      python3 bench/peer_vllm.py "$G/cases_$1.json" 2 > "$G/vllm_$1.txt" 2> "$G/vllm_$1.err"
    fi
    log "peer vllm $1 rc=$? $(grep -c -E 'tokens_per_s|sampling' "$G/vllm_$1.txt") cases"
    if [ "${SEEDED_TOO:-0}" = 1 ] && [ "$DEVICE" != cpu ]; then
      REQUEST_SEED=0 python3 bench/peer_vllm.py "$G/cases_$1.json" 2 > "$G/vllm_$1_seeded.txt" 2> "$G/vllm_$1_seeded.err"
      log "peer vllm $1 seeded rc=$?"
    fi
  }
  peer_vllm() {
    vllm_env
    for s in ${VSHAPES:-${SHAPES:-0.5b 1.5b 7b}}; do peer_on "$s"; done
  }
  real_model() {
    local m=${REAL_MODEL:-/root/rl/models/qwen2.5-coder-1.5b} t0=$SECONDS
    # import-gguf renames its whole directory into place: config.json means all of it.
    until [ -f "$m/config.json" ] || [ $((SECONDS - t0)) -gt "${REAL_WAIT:-900}" ]; do sleep 5; done
    [ -f "$m/config.json" ] || { log "real: no model at $m after $((SECONDS - t0)) s"; return 1; }
    log "real: $m after $((SECONDS - t0)) s"
    "$B/tandem" bench rollout --device "$DEVICE" --model "$m" --prompts "${REAL_PROMPTS:-$B/prompts.parquet}" \
      --limit "${REAL_LIMIT:-256}" --n "${REAL_N:-8,1}" --new-tokens "${REAL_NEW:-1024}" \
      --max-num-seqs "${REAL_SEQS:-2048}" --modes $MODES --runs 2 --cases-out "$G/cases_real.json" \
      > "$G/rollout_real.txt" 2>&1
    log "bench rollout real rc=$?"
    vllm_env
    peer_on real
  }
  peer_training() {
    for s in 0.5b 1.5b; do
      python3 bench/peer_update.py 3 --shape $s > "$G/peer_update_$s.txt" 2> "$G/peer_update_$s.err"
      log "peer update $s rc=$?"
      python3 bench/peer_update.py 3 --shape $s --logprob > "$G/peer_logprob_$s.txt" 2> "$G/peer_logprob_$s.err"
      log "peer logprob $s rc=$?"
    done
  }
  if [ "$DEVICE" = cpu ]; then
    log "start (cpu dry run)"
  else
    log "start ${GPU:+GPU $GPU: }$(nvidia-smi ${GPU:+-i "$GPU"} --query-gpu=name,driver_version --format=csv,noheader | head -1)"
    python3 -c "import torch; torch.zeros(1).cuda()"  # the driver's own first start, outside the timings
  fi
  for part in ${PARTS:-first rollout update vllm peers}; do
    case $part in
    first) first_run ;;
    gputest)
      "$B/tandem" gpu-test --json "$G/gpu_test.json" > "$G/gpu_test.log" 2>&1
      log "gpu-test rc=$? $(grep -E 'checks' "$G/gpu_test.log" | tail -1)" ;;
    gputest-*)
      # gputest-NAME: only the checks whose name contains NAME (e.g. gputest-paged).
      "$B/tandem" gpu-test --only "${part#gputest-}" > "$G/gpu_test_${part#gputest-}.log" 2>&1
      log "gpu-test --only ${part#gputest-} rc=$? $(grep -E 'checks' "$G/gpu_test_${part#gputest-}.log" | tail -1)" ;;
    attnprof) attn_profile ;;
    profile)
      for r in ${PROFILE_ROWS:-256}; do
        D=$B MODEL=qwen7b ROWS=$r OUT=$G bash bench/decode_profile.sh > "$G/profile_7b_$r.txt" 2>&1
        log "decode profile $r rc=$?"
      done ;;
    rollout) tandem_rollout ;;
    update) tandem_update ;;
    vllm) peer_vllm ;;
    real) real_model ;;
    peers) peer_training ;;
    *) log "unknown part $part" ;;
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
  python3 "$(dirname "$0")/vllm_summary.py" "$G" | tee "$G/summary.txt"
  # What comes back: one tarball of the plan's files (each cut to its last 2 MiB: a device
  # call returns at most 16 MiB a file) and the summary.
  pack=$(mktemp -d)
  mkdir -p "$pack/$(basename "$G")"
  for f in "$G"/*; do
    [ -f "$f" ] && tail -c 2097152 "$f" > "$pack/$(basename "$G")/$(basename "$f")"
  done
  tar czf "$OUT/vl.tgz" -C "$pack" "$(basename "$G")" && cp "$G/summary.txt" "$OUT/"
  rm -rf "$pack"
  ls -la "$OUT"
  ;;
esac
