#!/bin/bash
# One lease, several measurements: runs on the device machine detached (setsid), so that the
# GPUs work while later device calls carry the GSM8K model's pieces (each call carries at most
# 64 MiB). In order: `gpu-test` (GPUTEST_ONLY narrows it), bench/gpu_multi.sh with each word of
# MULTI as its PARTS, then, once the pieces are all in $R/pieces, a GSM8K run of
# bench/gsm8k_run.sh (GSM_* below; GSM_RUN empty: none). Logs and results go to $G; every later
# call can bring them home with `tar czf $OUT/g.tgz -C $(dirname $G) $(basename $G)`.
#   call 1 (carry .device/rl with bin.tar.xz and prompts.parquet, and the last piece in
#   .device/piece):
#     cp -r .device/rl /root/rl-carry && mkdir -p /root/src && cp -r bench pipelines /root/src/ \
#       && STEP=setup MODEL=0.5b bash bench/gsm8k_run.sh | tail -3
#     (cd /root/src && MULTI="g7bd equal,grpod" setsid nohup bash bench/lease.sh > /root/lease.out 2>&1 < /dev/null &)
#   calls 2..: one piece each (P=.device/pN STEP=piece bash bench/gsm8k_run.sh), then calls that
#   sleep, print $G/lease.log and bring $G home.
# Variables: C [/root/rl-carry] the carried directory; G [/root/lease]; R [/root/rl]; N [all
# GPUs], NS ["2 4"], SHAPES [0.5b] for gpu_multi.sh (in a MULTI word, commas separate parts);
# G7B_MICRO [8192; 4096 on GPUs under 100 GB]; MULTI words may add settings of their own run
# (g7bd:N=2:G7B_MICRO=4096); GSM_RUN [dp2], GSM_MODEL [0.5b], GSM_SPEC [the
# model's fast DAPO spec], GSM_GPUS [2], GSM_STEPS [120], GSM_SECS [480].
set -u
C=${C:-/root/rl-carry}
G=${G:-/root/lease}
export R=${R:-/root/rl}
mkdir -p "$G"
log() { echo "$(date +%T) $*" >> "$G/lease.log"; }
export NCCL_NVLS_ENABLE=0
B=/tmp/lease-bin
mkdir -p $B && tar -xJf "$C/bin.tar.xz" -C $B && cp "$C/prompts.parquet" $B/ || exit 1
log start
$B/tandem gpu-test ${GPUTEST_ONLY:+--only "$GPUTEST_ONLY"} --json "$G/gpu_test.json" > "$G/gpu_test.log" 2>&1
log "gpu-test rc=$? $(grep -E 'checks' "$G/gpu_test.log" | tail -1)"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
micro=${G7B_MICRO:-$([ "$mem" -lt 100000 ] && echo 4096 || echo 8192)}
gpus=$(nvidia-smi -L | wc -l)
k=0
# A MULTI word: the parts (commas between), then optionally :VAR=value settings of that run
# alone, e.g. g7bd:N=2:G7B_MICRO=4096.
for word in ${MULTI:-}; do
  k=$((k + 1))
  parts=${word%%:*}
  extra=()
  [ "$word" = "$parts" ] || IFS=: read -ra extra <<< "${word#*:}"
  env D=$B N=${N:-$gpus} NS="${NS:-2 4}" SHAPES=${SHAPES:-0.5b} PARTS="${parts//,/ }" \
    G7B_MICRO=$micro "${extra[@]}" OUT=$G/multi$k bash bench/gpu_multi.sh > "$G/multi$k.log" 2>&1
  log "gpu_multi.sh $word rc=$?"
done
[ -n "${GSM_RUN-dp2}" ] || { log done; exit 0; }
model=${GSM_MODEL:-0.5b}
# STEP=import fails until every piece is in (then joins, checks and imports them); 20 minutes
# at most (a lease lasts 30).
t0=$SECONDS
until STEP=import MODEL=$model bash bench/gsm8k_run.sh > "$G/import.log" 2>&1; do
  [ $((SECONDS - t0)) -lt 1200 ] || { log "the pieces did not come: $(tail -1 "$G/import.log")"; exit 1; }
  sleep 3
done
log "pieces in"
run=${GSM_RUN:-dp2}
STEP=run MODEL=$model SPEC=${GSM_SPEC:-pipelines/gsm8k-qwen2.5-coder-$model-dapo-fast-cuda.toml} RUN=$run \
  GPUS=${GSM_GPUS:-2} STEPS=${GSM_STEPS:-120} SECS=${GSM_SECS:-480} EVAL_EVERY=20 bash bench/gsm8k_run.sh > "$G/gsm.log" 2>&1
log "gsm8k $run rc=$?"
STEP=report MODEL=$model SPEC=${GSM_SPEC:-pipelines/gsm8k-qwen2.5-coder-$model-dapo-fast-cuda.toml} RUN=$run OUT=$G \
  bash bench/gsm8k_run.sh > "$G/report-$run.log" 2>&1
log done
