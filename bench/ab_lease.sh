#!/bin/bash
# Two builds of tandem in one lease (a refactor's before and after), detached on the device with
# setsid so that the plan outlives the device call that starts it:
#   1. the new build's whole `tandem gpu-test`;
#   2. `bench rollout`, `bench update` and `bench logprob` of both builds, alternately
#      (bench/gpu_bench.sh with BASE, no peers), then REPEATS [3] more alternations of
#      `bench rollout`; ab.log gets each rollout case's median per build;
#   3. on a machine of 2 GPUs or more, `bench/gpu_multi.sh PARTS=equal` at 2 ranks (one update
#      in one process against zero2 and full sharding, every f32 master tensor compared).
# Carry C [.device/ab] holding bin.tar.xz (the new build's release binaries: tandem and the
# stages), base.tar.xz (the old build's `tandem`) and prompts.parquet (`tandem prepare gsm8k`).
#   STEP=start bash bench/ab_lease.sh            unpack, start the plan detached, return
#   STEP=wait SECS=540 bash bench/ab_lease.sh    wait up to SECS for it, print its log and pack
#                                                everything it wrote into $OUT/ab.tgz
# G [/root/ab] is where the plan writes (ab.log: one line per part with its exit code).
set -u
STEP=${STEP:-start}
C=${C:-.device/ab}
G=${G:-/root/ab}
B=${B:-/root/ab-bin}
case $STEP in
start)
  rm -rf "$B" "$G" /root/ab-src
  mkdir -p "$B/base" "$G" /root/ab-src
  tar -xJf "$C/bin.tar.xz" -C "$B" && tar -xJf "$C/base.tar.xz" -C "$B/base" \
    && cp "$C/prompts.parquet" "$B/" && cp -r bench /root/ab-src/ \
    && mkdir -p /root/ab-src/tests && cp -r tests/fixtures /root/ab-src/tests/ || exit 1
  (cd /root/ab-src && setsid nohup env B="$B" G="$G" STEP=plan bash bench/ab_lease.sh \
    > "$G/plan.out" 2>&1 < /dev/null &)
  echo "started: $G/ab.log"
  ;;
plan)
  export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
  log() { echo "$(date +%T) $*" >> "$G/ab.log"; }
  log "start $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $(nvidia-smi -L | wc -l)"
  "$B/tandem" gpu-test --json "$G/gpu_test.json" > "$G/gpu_test.log" 2>&1
  log "gpu-test rc=$? $(grep -E 'checks' "$G/gpu_test.log" | tail -1)"
  D=$B BASE=$B/base PARTS="rollout update" PEERS=0 OUT=$G/bench bash bench/gpu_bench.sh > "$G/bench.log" 2>&1
  log "gpu_bench rc=$?"
  # More alternations of `bench rollout` (REPEATS [3]), then each case's median of the later
  # runs per build over every rollout run of the plan.
  for i in $(seq "${REPEATS:-3}"); do
    "$B/base/tandem" bench rollout --device cuda --modes graphs --runs 3 > "$G/rollout_base_$i.txt" 2>&1
    "$B/tandem" bench rollout --device cuda --modes graphs --runs 3 > "$G/rollout_new_$i.txt" 2>&1
  done
  python3 - "$G" >> "$G/ab.log" <<'PY'
import glob, json, statistics, sys
g = sys.argv[1]
tok = {}
for build in ("base", "new"):
    for path in glob.glob(f"{g}/rollout_{build}_*.txt") + glob.glob(f"{g}/bench/rollout_{build}.txt"):
        lines = [l for l in open(path).read().splitlines() if l.startswith("{")]
        for c in json.loads(lines[-1])["cases"] if lines else []:
            if c["run"] >= 2:
                tok.setdefault(c["case"], {}).setdefault(build, []).append(c["tokens_per_s"])
for case, by in tok.items():
    b, n = (statistics.median(by.get(k, [0.0])) for k in ("base", "new"))
    print(f"rollout {case}: base {b:.0f} new {n:.0f} tok/s (median of {len(by.get('new', []))}), new/base {n / max(b, 1e-9):.3f}")
PY
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    D=$B N=2 NS=2 PARTS=equal OUT=$G/multi W=/tmp/ab_multi bash bench/gpu_multi.sh > "$G/multi.log" 2>&1
    log "gpu_multi equal rc=$?"
  fi
  log done
  ;;
wait)
  t0=$SECONDS
  until grep -q ' done$' "$G/ab.log" 2> /dev/null || [ $((SECONDS - t0)) -ge "${SECS:-540}" ]; do
    sleep 5
  done
  cat "$G/ab.log"
  tar czf "$OUT/ab.tgz" -C "$(dirname "$G")" "$(basename "$G")"
  ;;
esac
