#!/bin/bash
# Issue 22 on one host with N GPUs (N = 1 works too, for a dry run on one GPU). NCCL_NVLS_ENABLE=0
# everywhere (tandem launch also sets it in every rank's environment).
#   check    `gpu-test` on GPU 0 (GPUTEST_ONLY narrows it), and bench/gpu_dist.sh at 1 and N
#            ranks: dist-test (every collective against host values), `bench dist` (collectives
#            up to 1 GiB, weight sync of the 0.5B/1.5B/7B shapes at 32-512 MB buckets), the
#            PyTorch NCCL peer (bench/peer_nccl.py, when python3 imports torch; N >= 2) and the
#            SIGKILL / hang fault checks of one rank
#   rollout  data-parallel rollout tokens/s at 1 rank and at each world size of NS on the same
#            prompts (64 per GPU, random Qwen2.5 shapes of SHAPES, n = 8, 512 tokens,
#            --ignore-eos), and the rows of 1 and N ranks compared
#   grpo     whole GRPO steps (64 prompts x 8 x 512 tokens per GPU, random shapes of SHAPES,
#            in-process stages) through the pipeline at gpus = 1 and at each of NS: rollout and
#            update (sharded optimizer, two mini-batches) data parallel
#   grpod    the same steps with daemon = true: one warm daemon at gpus = 1, a daemon group (one
#            daemon per GPU under tandem launch) at gpus = N
#   equal    one `update` (sft loss, 512 rows of a random 0.5B shape, bf16 compute, f32 masters,
#            EQ_FLAGS ["--lr 0.1 --adam-eps 1": a step proportional to the gradient]) on
#            the same batch in one process and at each of NS ranks, zero2 and --shard full: loss, grad
#            norm, and every tensor of the f32 masters compared (relative error of the weights,
#            and of the step itself, w_after - w_before)
#   fault    SIGKILL of rank 1 of a data-parallel rollout mid-generation: the launcher and the
#            other ranks stop within 60 s naming it, and no output file is written (N >= 2);
#            the same for rank 1 of a daemon group serving a rollout (the client says so)
#   pfault   a 4-step GRPO pipeline on a daemon group (gpus = N, daemon = true, files every 2
#            steps), then the same with rank 1's daemon SIGKILLed in step 3's update: the seconds
#            from the kill until the runner reports the group failed, and the final checkpoints
#            compared (files by sha256; the optimizer state numerically, against a second
#            undisturbed run's as the run-to-run noise) (N >= 2)
#   hang     rank 1 of `dist-test` stops answering: every rank and the launcher stop within
#            the launcher's --timeout 10, and the message names the collective (N >= 2)
#   g7b      one whole GRPO step of a random Qwen2.5-7B shape on N ranks, stage by stage
#            (rollout and update under tandem launch, update --shard full without an optimizer
#            file; 64 prompts x 8 x 512 tokens per GPU): seconds per stage, tokens/s per GPU and
#            peak memory per GPU (nvidia-smi every 0.5 s)
#   g7bd     whole GRPO steps of the same 7B shape on a daemon group (gpus = N, daemon = true,
#            shard = "full"; G7B_STEPS [3], G7B_MICRO [8192: 4096 on 80 GB GPUs]): seconds per
#            stage and step, tokens/s per GPU against verl's 1,085, peak memory per GPU
#   g7bl     GRPO-LoRA steps of the same 7B shape on one GPU's daemon (rank 32, alpha 64, every
#            projection; G7B_STEPS, G7B_MICRO as g7bd): step time, tokens/s, peak memory
# Expects the stripped release binaries (tandem, pipeline, rollout, score, advantage,
# ref-logprob, update, sync-weights) and prompts.parquet (`tandem prepare gsm8k`) in $D.
#   D=.device N=2 bench/gpu_multi.sh                 (OUT defaults to /tmp/gpu_multi)
#   PARTS="check rollout" N=1 ...                    a subset
#   PACK=1 ...                                       $OUT packed into $OUT.tgz at the end (a device
#                                                    call returns a limited number of files)
#   N=4 NS="2 4" SHAPES="0.5b 1.5b" PARTS="rollout grpod"   scaling at 1, 2 and 4 GPUs
# NS: the world sizes past 1 of check, rollout, grpo, grpod and equal [N]; N: that of the others.
# Ends with one table: part, ranks, metric, value.
set -u
D=${D:-.device}
T=$D/tandem
N=${N:-2}
NS=${NS:-$N}
SHAPES=${SHAPES:-0.5b}
PARTS=${PARTS:-check equal rollout grpo grpod fault}
OUT=${OUT:-/tmp/gpu_multi}
W=${W:-/tmp/gpu_multi_work}
mkdir -p "$OUT" "$W"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TANDEM_CACHE=${TANDEM_CACHE:-/root/tandem-cache}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
GPUS=$(nvidia-smi -L | wc -l)
[ "$N" -le "$GPUS" ] || { echo "N=$N but $GPUS GPU(s)"; exit 2; }
t0=$SECONDS
q05() {
  [ -f "$W/q05/config.json" ] || $T init-model --like qwen2 --layers 24 --hidden 896 --heads 14 \
    --kv-heads 2 --ffn 4864 --vocab 151936 --tie true --rope-theta 1000000 --rms-norm-eps 1e-6 \
    --seed 1 --out "$W/q05" > /dev/null
}
q15() {
  [ -f "$W/q15/config.json" ] || $T init-model --like qwen2 --layers 28 --hidden 1536 --heads 12 \
    --kv-heads 2 --ffn 8960 --vocab 151936 --tie true --rope-theta 1000000 --rms-norm-eps 1e-6 \
    --seed 1 --out "$W/q15" > /dev/null
}
q7() {
  [ -f "$W/q7/config.json" ] || $T init-model --like qwen2 --layers 28 --hidden 3584 --heads 28 \
    --kv-heads 4 --ffn 18944 --vocab 152064 --tie false --rope-theta 1000000 --rms-norm-eps 1e-6 \
    --seed 1 --out "$W/q7" > "$OUT/g7b_init.log" 2>&1
}
# The prompts of the GRPO parts (3-digit additions), made on first use.
add_set() {
  [ -f "$W/add.parquet" ] || $T prepare synth --task add --digits 3 --n 4096 --seed 1 \
    --out "$W/add.parquet" > /dev/null
}
# The spec of the GRPO parts' steps: FILE STEPS GPUS DAEMON MODEL PROMPTS-PER-GPU
# MAX-NEW-TOKENS, then the [update] lines after the learning rate.
grpo_spec() {
  cat > "$1" <<EOF
seed = 1
steps = $2
device = "cuda"
gpus = $3
daemon = $4
[model]
path = "$5"
[data]
train = "$W/add.parquet"
prompts-per-step = $(($6 * $3))
[rollout]
n = 8
max-new-tokens = $7
ignore-eos = true
max-prompt-tokens = 64
raw-prompt = true
[score]
reward = "exact"
[advantage]
estimator = "grpo"
[update]
lr = 0.000001
$8
EOF
}
# Every GPU's used memory (MiB) into file $1 every 0.5 s, in the background until
# `kill $SMI`; mem_peak prints each GPU's peak of such a file.
mem_start() {
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > "$1" &
  SMI=$!
}
mem_peak() {
  awk -F', *' '$2 ~ /^[0-9]+$/ && $2 + 0 > p[$1] { p[$1] = $2 + 0 }
    END { for (i in p) printf "GPU %s %d  ", i, p[i]; print "" }' "$1"
}
# Whole GRPO steps of the random 7B shape on a daemon: NAME GPUS [update] LINES; seconds per
# stage and step, tokens/s per GPU against verl's 1,085, peak memory per GPU.
g7b_daemon() {
  local name=$1 n=$2
  q7
  add_set
  grpo_spec "$W/$name.toml" "${G7B_STEPS:-3}" "$n" true "$W/q7" 64 512 "$3"
  mem_start "$OUT/${name}_mem.csv"
  rm -rf "$W/${name}_run"
  local t_run=$SECONDS
  TANDEM_BIN_DIR=$D timeout -s INT "${G7B_SECS:-480}" $D/pipeline run "$W/$name.toml" \
    --run-dir "$W/${name}_run" > "$OUT/$name.log" 2>&1
  echo "pipeline $name gpus=$n rc=$? in $((SECONDS - t_run)) s"
  kill $SMI
  cp "$W/${name}_run/metrics.jsonl" "$OUT/$name.jsonl" 2> /dev/null
  cp "$W/${name}_run/daemon.log" "$OUT/${name}_daemon.log" 2> /dev/null
  rm -rf "$W/${name}_run/ckpt"
  echo "$name peak memory per GPU (MiB): $(mem_peak "$OUT/${name}_mem.csv")"
  python3 - "$OUT" "$n" "$name" <<'PY'
import json, sys
out, n, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    lines = [json.loads(l) for l in open(f"{out}/{name}.jsonl") if l.strip()]
except OSError:
    lines = []
for l in lines:
    t = {k[5:]: round(v, 2) for k, v in l.items() if k.startswith("time/")}
    tps = l.get("perf/tokens_per_s", 0) / n
    print(f"{name} step {l['step']}: {t}; {tps:.0f} tok/s per GPU ({tps / 1085:.2f}x verl's 1,085 tok/s/GPU)")
    # Where the sharded update's communication went (rank 0): gathers, prefetches, reduce-scatters
    # (and a checkpointing step's state gather and shard write).
    sh = {k[13:]: (round(v, 3) if isinstance(v, float) else v) for k, v in l.items()
          if k.startswith("update/shard/") and k[13:] in ("unit_gathers", "unit_prefetches",
          "unit_gather_seconds", "reduce_scatter_seconds", "overlapped_buckets", "staging_bytes",
          "state_gather_seconds", "shard_write_seconds")}
    if sh:
        print(f"{name} step {l['step']} shard: {sh}")
    # Rank 0's update phase: device memory in use (before, peak, after) and the generation copy.
    dm = {k[14:]: (round(v / 2**30, 1) if "memory" in k or "peak" in k else round(v, 3))
          for k, v in l.items() if k.startswith("update/daemon/") and isinstance(v, (int, float))
          and not isinstance(v, bool) and any(w in k for w in ("memory_in_use", "phase_peak", "copy_seconds"))}
    if dm:
        print(f"{name} step {l['step']} update memory GiB / copy s: {dm}")
PY
}
# The random model of a shape (0.5b or 1.5b), made on first use; its directory is printed.
shape_model() {
  case $1 in
  0.5b) q05; echo "$W/q05" ;;
  1.5b) q15; echo "$W/q15" ;;
  *) echo "SHAPES: unknown shape $1 (0.5b or 1.5b)" >&2; exit 2 ;;
  esac
}
# The world sizes of a scaling part: 1, then those of NS this machine has.
sizes() { echo 1; for n in $NS; do [ "$n" -gt 1 ] && [ "$n" -le "$GPUS" ] && echo "$n"; done; }
# The ranks of a world of n: the plain binary at 1 (the one-process path), tandem launch above.
ranks() { local n=$1; shift; if [ "$n" = 1 ]; then "$@"; else $T launch --nproc-per-node "$n" -- "$@"; fi; }

for part in $PARTS; do
  case $part in
  check)
    $T gpu-test ${GPUTEST_ONLY:+--only "$GPUTEST_ONLY"} --json "$OUT/gpu_test.json" > "$OUT/gpu_test.log" 2>&1
    echo "gpu-test rc=$? $(grep -E 'checks' "$OUT/gpu_test.log" | tail -1)"
    NS=$(sizes | grep -vx 1 | tr '\n' ' ') D=$D OUT=$OUT/dist \
      DIST_ARGS="--shapes qwen0.5b,qwen1.5b,qwen7b --bucket-mb 32,64,128,256,512" \
      DIST_ARGS_1="--shapes qwen0.5b --bucket-mb 128" \
      bash bench/gpu_dist.sh > "$OUT/gpu_dist.log" 2>&1
    echo "gpu_dist.sh rc=$?"; tail -8 "$OUT/gpu_dist.log"
    ;;
  rollout)
    for shape in $SHAPES; do
      m=$(shape_model "$shape") || exit 2
      for n in $(sizes); do
        ranks "$n" $D/rollout --model "$m" --in "$D/prompts.parquet" --limit $((64 * n)) --raw-prompt \
          --n 8 --max-new-tokens 512 --ignore-eos --seed 7 --device cuda \
          --out "$W/rollout_${shape}_$n.parquet" --metrics "$OUT/rollout_${shape}_$n.json" > "$OUT/rollout_${shape}_$n.log" 2>&1
        echo "rollout $shape n=$n rc=$?"; tail -1 "$OUT/rollout_${shape}_$n.log"
      done
      # The first 64 prompts' rows (one rank's) against those of every larger world.
      for n in $(sizes | grep -vx 1); do
        [ -f "$W/rollout_${shape}_$n.parquet" ] || continue
        python3 - "$W/rollout_${shape}_1.parquet" "$W/rollout_${shape}_$n.parquet" > "$OUT/rollout_compare_${shape}_$n.txt" 2>&1 <<'PY'
import sys
import pyarrow.parquet as pq
a, b = (pq.read_table(p) for p in sys.argv[1:3])
ids_a, ids_b = a.column("response_ids").to_pylist(), b.column("response_ids").to_pylist()
same = sum(x == y for x, y in zip(ids_a, ids_b))
print(f"rows {len(ids_a)} vs {len(ids_b)}; identical response_ids in {same} of the first {min(len(ids_a), len(ids_b))}")
la, lb = a.column("rollout_logprobs").to_pylist(), b.column("rollout_logprobs").to_pylist()
d = [abs(u - v) for x, y, i, j in zip(la, lb, ids_a, ids_b) if i == j for u, v in zip(x, y)]
print(f"max |rollout_logprobs 1 - N| over identical rows: {max(d) if d else float('nan'):.3g}")
PY
        echo "rows 1 vs $n ranks ($shape) rc=$?"; tail -2 "$OUT/rollout_compare_${shape}_$n.txt"
      done
    done
    ;;
  grpo|grpod)
    dm=$([ "$part" = grpod ] && echo true || echo false)
    add_set
    for shape in $SHAPES; do
      m=$(shape_model "$shape") || exit 2
      mbt=$([ "$shape" = 0.5b ] && echo 16384 || echo 8192)
      for n in $(sizes); do
        grpo_spec "$W/${part}_${shape}_$n.toml" "${GRPO_STEPS:-3}" "$n" "$dm" "$m" 64 512 \
          "mini-batch-size = $((256 * n))
micro-batch-tokens = $mbt"
        rm -rf "$W/${part}_run_${shape}_$n"
        TANDEM_BIN_DIR=$D $D/pipeline run "$W/${part}_${shape}_$n.toml" --run-dir "$W/${part}_run_${shape}_$n" \
          > "$OUT/${part}_${shape}_$n.log" 2>&1
        echo "pipeline $part $shape gpus=$n rc=$?"
        cp "$W/${part}_run_${shape}_$n/metrics.jsonl" "$OUT/${part}_${shape}_$n.jsonl" 2> /dev/null
        cp "$W/${part}_run_${shape}_$n/daemon.log" "$OUT/${part}_daemon_${shape}_$n.log" 2> /dev/null
        rm -rf "$W/${part}_run_${shape}_$n"
      done
    done
    ;;
  equal)
    q05
    [ -f "$W/sft.parquet" ] || $D/rollout --model "$W/q05" --in "$D/prompts.parquet" --limit 512 \
      --raw-prompt --n 1 --max-new-tokens 256 --ignore-eos --seed 3 --device cuda \
      --out "$W/sft.parquet" > "$OUT/equal_rollout.log" 2>&1
    # One process, then zero2 and full sharding at each world size of NS.
    for mode in one $(for n in $(sizes | grep -vx 1); do echo "zero2_$n full_$n"; done); do
      rm -rf "$W/eq_$mode"
      case $mode in
      one) pre=(); extra=() ;;
      *) pre=($T launch --nproc-per-node "${mode#*_}" --); extra=(--shard "${mode%_*}") ;;
      esac
      # Adam's first step is lr·g/(|g| + eps): with eps = 1 it is proportional to g, so the
      # step's relative error measures the gradient's (with a small eps it is ~lr·sign(g), and
      # a rounding-level gradient flips a whole step).
      # shellcheck disable=SC2086
      "${pre[@]}" $D/update --model "$W/q05" --in "$W/sft.parquet" --loss sft ${EQ_FLAGS:---lr 0.1 --adam-eps 1} \
        --device cuda "${extra[@]}" --out-model "$W/eq_$mode" --metrics "$OUT/equal_$mode.json" \
        > "$OUT/equal_$mode.log" 2>&1
      echo "update $mode rc=$? $(grep -m1 '^update: [0-9]' "$OUT/equal_$mode.log")"
      # N ranks write their optimizer shards: merged into one optimizer.safetensors to compare.
      if [ "$mode" != one ] && [ ! -f "$W/eq_$mode/optimizer.safetensors" ]; then
        rm -rf "$W/eq_${mode}_merged"
        $T merge-shards "$W/eq_$mode" --out "$W/eq_${mode}_merged" > "$OUT/equal_merge_$mode.log" 2>&1 \
          && rm -rf "$W/eq_$mode" && mv "$W/eq_${mode}_merged" "$W/eq_$mode"
      fi
    done
    python3 - "$W/q05" "$W/eq_one" $(for n in $(sizes | grep -vx 1); do echo "$W/eq_zero2_$n $W/eq_full_$n"; done) > "$OUT/equal_compare.txt" 2>&1 <<'PY'
import sys
from safetensors.torch import load_file
base, one, *others = sys.argv[1:]
w0 = load_file(f"{base}/model.safetensors")
ref = load_file(f"{one}/optimizer.safetensors")
def masters(d):
    return {k[len("master."):]: v for k, v in d.items() if k.startswith("master.")}
m1 = masters(ref)
for other in others:
    try:
        m2 = masters(load_file(f"{other}/optimizer.safetensors"))
    except Exception as e:
        print(other, "no optimizer state:", e)
        continue
    rows = []
    for k, a in m1.items():
        if k not in m2:
            continue
        a, b = a.double(), m2[k].double()
        w = ((a - b).norm() / a.norm().clamp_min(1e-30)).item()
        d = None
        if k in w0 and w0[k].shape == a.shape:
            s1 = a - w0[k].double()
            d = ((a - b).norm() / s1.norm().clamp_min(1e-30)).item()
        rows.append((k, w, d))
    zero_grad = [r for r in rows if r[0].endswith("k_proj.bias")]
    rest = [r for r in rows if not r[0].endswith("k_proj.bias")]
    ws = sorted(r[1] for r in rest)
    ds = sorted(r[2] for r in rest if r[2] is not None)
    print(f"{other}: {len(rows)} tensors compared ({len(zero_grad)} k_proj.bias apart: zero gradient in exact arithmetic)")
    print(f"  weights, relative error: max {ws[-1]:.3e} ({max(rest, key=lambda r: r[1])[0]}), median {ws[len(ws)//2]:.3e}")
    over = [r[0] for r in rest if r[1] > 1e-3]
    print(f"  tensors over 1e-3: {len(over)} of {len(rest)} ({sum(k.endswith('.bias') for k in over)} of them zero-initialised biases)")
    num = sum(((m1[k].double() - m2[k].double()) ** 2).sum().item() for k in m1 if k in m2)
    den = sum((m1[k].double() ** 2).sum().item() for k in m1 if k in m2)
    print(f"  all weights together, relative error: {(num / max(den, 1e-300)) ** 0.5:.3e}")
    if ds:
        print(f"  the step w1-w0, relative error: max {ds[-1]:.3e}, p90 {ds[int(0.9*len(ds))]:.3e}, median {ds[len(ds)//2]:.3e}")
    if zero_grad:
        print(f"  k_proj.bias weights: max {max(r[1] for r in zero_grad):.3e}")
PY
    cat "$OUT/equal_compare.txt"
    ;;
  fault)
    if [ "$N" -lt 2 ]; then echo "fault: needs N >= 2"; continue; fi
    q05
    rm -f "$W/fault.parquet"
    start=$SECONDS
    $T launch --nproc-per-node "$N" -- $D/rollout --model "$W/q05" --in "$D/prompts.parquet" \
      --limit $((64 * N)) --raw-prompt --n 8 --max-new-tokens 512 --ignore-eos --device cuda \
      --out "$W/fault.parquet" > "$OUT/fault.log" 2>&1 &
    launcher=$!
    victim=""
    for _ in $(seq 120); do
      sleep 1
      for p in $(pgrep -P "$launcher"); do
        tr '\0' '\n' < /proc/$p/environ 2> /dev/null | grep -qx RANK=1 && victim=$p
      done
      [ -n "$victim" ] && [ $((SECONDS - start)) -ge 20 ] && break
    done
    [ -n "$victim" ] && kill -9 "$victim"
    killed=$SECONDS
    wait "$launcher"; rc=$?
    echo "fault: SIGKILL rank 1 (pid ${victim:-none}) after $((killed - start)) s; launcher rc=$rc after $((SECONDS - killed)) s more; output file: $([ -e "$W/fault.parquet" ] && echo WRITTEN || echo none)"
    grep -m2 -E '^error: rank|rank 1' "$OUT/fault.log"
    # The same on a daemon group: rank 1's daemon SIGKILLs itself after generating its share.
    rm -f "$W/fault_d.parquet" "$W/fault_d.marker" "$W/fault_d.sock"*
    TANDEM_DAEMON_KILL_IN_ROLLOUT="$W/fault_d.marker" TANDEM_DAEMON_KILL_RANK=1 \
      $T launch --nproc-per-node "$N" -- $T daemon --device cuda --socket "$W/fault_d.sock" \
      --policy "$W/q05" > "$OUT/fault_daemon.log" 2>&1 &
    group=$!
    for _ in $(seq 600); do
      $T daemon-ctl --socket "$W/fault_d.sock" health > /dev/null 2>&1 && break
      sleep 1
    done
    start=$SECONDS
    $D/rollout --model "$W/q05" --in "$D/prompts.parquet" --limit $((64 * N)) --raw-prompt \
      --n 8 --max-new-tokens 512 --ignore-eos --device cuda --daemon "$W/fault_d.sock" \
      --out "$W/fault_d.parquet" > "$OUT/fault_client.log" 2>&1
    crc=$?
    # The group should be gone by itself; stopped here after 90 s if not.
    for _ in $(seq 90); do kill -0 "$group" 2> /dev/null || break; sleep 1; done
    kill "$group" 2> /dev/null
    wait "$group"; grc=$?
    echo "fault (daemon group): client rc=$crc, group launcher rc=$grc, $((SECONDS - start)) s after the job was sent; output file: $([ -e "$W/fault_d.parquet" ] && echo WRITTEN || echo none)"
    grep -m1 'error' "$OUT/fault_client.log"
    grep -m2 -E 'stopping: rank 1|^error: rank 1' "$OUT/fault_daemon.log"
    ;;
  pfault)
    if [ "$N" -lt 2 ]; then echo "pfault: needs N >= 2"; continue; fi
    q05
    add_set
    cat > "$W/pfault.toml" <<EOF
seed = 1
steps = 4
device = "cuda"
gpus = $N
daemon = true
[model]
path = "$W/q05"
[data]
train = "$W/add.parquet"
prompts-per-step = $((16 * N))
[rollout]
n = 8
max-new-tokens = 128
max-prompt-tokens = 64
raw-prompt = true
[score]
# Any letter scores: the samples of a prompt differ, so every step has gradients.
reward = "regex:[a-z]"
format-score = 1.0
[advantage]
estimator = "grpo"
[update]
lr = 0.00001
mini-batch-size = $((64 * N))
[checkpoint]
every = 2
keep-last = 2
EOF
    # group2: the undisturbed run again, to tell run-to-run noise from what the kill changed.
    for run in group killed group2; do
      rm -rf "$W/pf_$run"
      env=()
      # The marker's time is the kill's (read after the runs).
      [ $run = killed ] && rm -f "$W/pf_marker" && env=(TANDEM_DAEMON_KILL_IN_UPDATE="$W/pf_marker" TANDEM_DAEMON_KILL_RANK=1 TANDEM_DAEMON_KILL_AT_STEP=3)
      # Every output line with its time, to time the failure against the kill.
      env "${env[@]}" TANDEM_BIN_DIR=$D $D/pipeline run "$W/pfault.toml" --run-dir "$W/pf_$run" 2>&1 \
        | while IFS= read -r l; do printf '%s %s\n' "$(date +%s.%N)" "$l"; done > "$OUT/pfault_$run.log"
      echo "pipeline pfault $run rc=${PIPESTATUS[0]}"
    done
    cp "$W/pf_killed/daemon.log" "$OUT/pfault_daemon.log" 2> /dev/null
    if [ -f "$W/pf_marker" ]; then
      python3 - "$W/pf_marker" "$OUT/pfault_killed.log" <<'PY'
import os, sys
kill = os.path.getmtime(sys.argv[1])
for line in open(sys.argv[2]):
    t, _, text = line.partition(" ")
    if "daemon group failed" in text or "failed with the daemon gone" in text:
        print(f"pfault: rank 1 SIGKILLed; the runner reported it {float(t) - kill:.1f} s later: {text.strip()[:200]}")
        break
else:
    print("pfault: no failure reported by the runner")
PY
    else
      echo "pfault: the kill hook did not fire"
    fi
    grep -m2 -E 'stopping: ' "$OUT/pfault_daemon.log"
    # Every file of the final checkpoint (model, per-rank optimizer shards, trainer state).
    for f in $(cd "$W/pf_group/ckpt/step-0004" && find . -type f | sort); do
      a=$(sha256sum < "$W/pf_group/ckpt/step-0004/$f" | cut -c1-16)
      b=$(sha256sum < "$W/pf_killed/ckpt/step-0004/$f" 2> /dev/null | cut -c1-16)
      echo "pfault final $f: $([ "$a" = "$b" ] && echo IDENTICAL || echo "DIFFERENT ($a vs ${b:-missing})")"
    done
    # The optimizer state (per-rank shards merged) of the killed and the second run against the
    # first, relative error over all tensors.
    for run in group killed group2; do
      rm -rf "$W/pf_${run}_merged"
      $T merge-shards "$W/pf_$run/ckpt/step-0004" --out "$W/pf_${run}_merged" > /dev/null 2>&1 \
        || echo "pfault: merge-shards of $run failed"
    done
    python3 - "$W" <<'PY'
import sys
from safetensors.torch import load_file
w = sys.argv[1]
def load(run):
    return load_file(f"{w}/pf_{run}_merged/optimizer.safetensors")
ref = load("group")
for run in ("killed", "group2"):
    try:
        other = load(run)
    except Exception as e:
        print(f"pfault optimizer {run}: not loaded: {e}")
        continue
    same = sum(bool((ref[k] == other[k]).all()) for k in ref if k in other)
    for kind in ("master.", "exp_avg.", "exp_avg_sq."):
        keys = [k for k in ref if k.startswith(kind) and k in other]
        num = sum(((ref[k].double() - other[k].double()) ** 2).sum().item() for k in keys)
        den = sum((ref[k].double() ** 2).sum().item() for k in keys)
        print(f"pfault optimizer {run} vs group, {kind[:-1]}: relative error {(num / max(den, 1e-300)) ** 0.5:.3e} over {len(keys)} tensors")
    print(f"pfault optimizer {run} vs group: {same} of {len(ref)} tensors bit for bit")
PY
    ;;
  hang)
    if [ "$N" -lt 2 ]; then echo "hang: needs N >= 2"; continue; fi
    start=$SECONDS
    timeout -s KILL 120 $T launch --nproc-per-node "$N" --timeout 10 -- $T dist-test --device cuda \
      --fail-rank 1 --fail-mode hang > "$OUT/hang.log" 2>&1
    echo "hang rank 1: rc=$? after $((SECONDS - start)) s"
    grep -E 'stopping|^error' "$OUT/hang.log" | head -4 | cut -c1-300
    ;;
  g7b)
    q7
    add_set
    # One GRPO step stage by stage (the pipeline's in-process stages, as commands.sh shows them),
    # each model stage on N ranks; update keeps no optimizer file (a 7B checkpoint with its f32
    # masters and moments is ~106 GB, more than some machines' disks).
    mem_start "$OUT/g7b_mem.csv"
    rm -rf "$W/g7b_u"
    t_step=$SECONDS
    timeout -s INT "${G7B_SECS:-420}" bash -c '
      set -e
      t=$SECONDS
      $0 launch --nproc-per-node $2 -- $1/rollout --model $3/q7 --in $3/add.parquet --limit $((64 * $2)) \
        --raw-prompt --n 8 --max-new-tokens 512 --ignore-eos --max-prompt-tokens 64 --seed 1 --device cuda \
        --out $3/g7b_r.parquet --metrics $4/g7b_rollout.json > $4/g7b_rollout.log 2>&1
      echo "rollout $((SECONDS - t)) s"; t=$SECONDS
      $1/score --in $3/g7b_r.parquet --out $3/g7b_s.parquet --reward exact > /dev/null
      $1/advantage --in $3/g7b_s.parquet --out $3/g7b_a.parquet --estimator grpo > /dev/null
      echo "score+advantage $((SECONDS - t)) s"; t=$SECONDS
      $0 launch --nproc-per-node $2 -- $1/update --model $3/q7 --in $3/g7b_a.parquet --out-model $3/g7b_u \
        --shard full --skip-optimizer-state --lr 1e-6 --micro-batch-tokens ${5:-8192} --device cuda \
        --metrics $4/g7b_update.json > $4/g7b_update.log 2>&1
      echo "update $((SECONDS - t)) s"
    ' "$T" "$D" "$N" "$W" "$OUT" "${G7B_MICRO:-8192}"
    echo "g7b step rc=$? in $((SECONDS - t_step)) s (stages started one after another; files, no daemon)"
    kill $SMI
    tail -1 "$OUT/g7b_rollout.log"; grep -m1 '^update: [0-9]' "$OUT/g7b_update.log" || tail -3 "$OUT/g7b_update.log"
    echo "g7b peak memory per GPU (MiB): $(mem_peak "$OUT/g7b_mem.csv")"
    python3 - "$OUT" "$N" $((SECONDS - t_step)) <<'PY'
import json, sys
out, n, step = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
try:
    r = json.load(open(f"{out}/g7b_rollout.json"))
    toks = r["prompt_tokens"] + r["response_tokens"]
    print(f"g7b: {toks} tokens (prompt + response) in a {step:.0f} s step: {toks / step / n:.0f} tok/s per GPU (verl's 7B GSM8K GRPO: 1,085 tok/s/GPU on 8 GPUs)")
except (OSError, KeyError, ValueError) as e:
    print("g7b: no rollout metrics:", e)
PY
    ;;
  g7bd)
    # Whole GRPO steps of the 7B shape on a daemon group (gpus = N, daemon = true,
    # shard = "full"): the warm steps, without the files the stage processes of g7b load and
    # write. Step 1 builds the sharded state; the last step writes the checkpoint.
    g7b_daemon g7bd "$N" "shard = \"full\"
micro-batch-tokens = ${G7B_MICRO:-8192}"
    ;;
  g7bl)
    # GRPO-LoRA steps of the 7B shape on one GPU's daemon: rank 32, alpha 64 on every
    # projection; the frozen base has no master or optimizer state (issue 37's 80 GB step).
    g7b_daemon g7bl 1 "lora-rank = 32
lora-alpha = 64
micro-batch-tokens = ${G7B_MICRO:-8192}"
    ;;
  esac
done

python3 - "$OUT" "$N" <<'PY'
import glob, json, os, sys
out, N = sys.argv[1], int(sys.argv[2])
rows = []
def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return None
for path in sorted(glob.glob(f"{out}/dist/bench_dist_*.json")):
    n = path.rsplit("_", 1)[1].split(".")[0]
    j = load(path) or {}
    for c in j.get("collectives", []) if isinstance(j, dict) else []:
        if c.get("bytes", 0) >= 1 << 30:
            rows.append(("dist", n, f"{c['op']} {c['dtype']} 1 GiB busbw GB/s", f"{c['busbw_gbs']:.1f}"))
    for w in j.get("weight_sync", []) if isinstance(j, dict) else []:
        for t in w["timing"] if isinstance(w["timing"], list) else [w["timing"]]:
            rows.append(("sync", n, f"{w['shape']} {t['bucket_mb']:.0f} MB ms / busbw GB/s", f"{t['median_ms']:.1f} / {t['busbw_gbs']:.1f}"))
for path in sorted(glob.glob(f"{out}/dist/peer_nccl_*.json")):
    n = path.rsplit("_", 1)[1].split(".")[0]
    j = load(path)
    rows.append(("peer", n, "torch.distributed (bench/peer_nccl.py)", json.dumps(j)[:100] if j else "?"))
import re
for shape in sorted({re.sub(r"^(rollout|grpod?)_(.*)_\d+\.(json|jsonl)$", r"\2", os.path.basename(p))
                     for p in glob.glob(f"{out}/rollout_*_*.json") + glob.glob(f"{out}/grpo*_*_*.jsonl")}):
    base = None
    sizes = sorted({int(p.rsplit("_", 1)[1].split(".")[0]) for p in glob.glob(f"{out}/*_{shape}_*.json*")})
    for n in sizes:
        m = load(f"{out}/rollout_{shape}_{n}.json")
        if m:
            tps = m["response_tokens"] / max(m["generation_seconds"], 1e-9)
            base = base or tps
            rows.append(("rollout", str(n), f"{shape} response tok/s (all ranks) / per GPU vs 1", f"{tps:.0f} / {100 * tps / n / base:.0f}%"))
    for part in ("grpo", "grpod"):
        base_t = {}
        for n in sizes:
            try:
                lines = [json.loads(l) for l in open(f"{out}/{part}_{shape}_{n}.jsonl") if l.strip()]
            except (OSError, ValueError):
                continue
            # Steps that wrote no checkpoint (the last one writes the model and optimizer
            # files), past the first where there are several.
            later = [l for l in lines if not l.get("update/weights_saved")]
            later = later[1:] if len(later) > 1 else later
            for k in ("time/rollout", "time/update", "time/sync", "time/step", "perf/rollout_tokens_per_s", "update/tokens_per_s"):
                v = sorted(l[k] for l in later if k in l)
                if not v:
                    continue
                med = v[len(v) // 2]
                extra = ""
                # The work per GPU is the same at every size: efficiency = t(1) / t(n).
                if k.startswith("time/"):
                    base_t.setdefault(k, med)
                    extra = f" ({100 * base_t[k] / max(med, 1e-9):.0f}% of 1 GPU's per GPU)"
                rows.append((part, str(n), f"{shape} median {k} (warm steps)", f"{med:.3f}{extra}"))
print(f"{'part':8} {'ranks':5} {'metric':48} value")
for r in rows:
    print(f"{r[0]:8} {r[1]:5} {r[2]:48} {r[3]}")
PY
echo "done in $((SECONDS - t0)) s"
# The device tool returns a limited number of files: PACK=1 leaves $OUT as one $OUT.tgz.
if [ "${PACK:-0}" = 1 ]; then
  tar -czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")" && rm -rf "$OUT"
fi
