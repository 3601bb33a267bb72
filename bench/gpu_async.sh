#!/bin/bash
# Issue 40 on one host: colocated GRPO steps against placed ones (`[placement]`, docs/DISTRIBUTED.md
# "Placement"): the colocated daemon group on all N GPUs, then for each placement of PLACEMENTS
# ("R+T": GPUs 0..R-1 roll out, the next T train) each mode of MODES (default: the synchronous
# mode, one step off-policy, and fully asynchronous with rounds of ROUND tokens and
# max-staleness K). Per run: seconds per step (mean of the steps after the first), tokens/s per GPU,
# and the weight transfer's GB/s (broadcast seconds only). NCCL_NVLS_ENABLE=0 everywhere.
#   D=.device N=4 bench/gpu_async.sh                       random 1.5B shape, responses up to 2048
#   SHAPE=7b PLACEMENTS="1+3 2+2" ...                       the 7B shape
#   MODEL=/path/to/Qwen2.5-Coder PROMPTS=$D/gsm8k.parquet   a real model and its long-tailed lengths
#   DEVICE=cpu N=3 SHAPE=tiny MAX_NEW=8 PLACEMENTS=1+2 ...  a dry run on CPU processes
# Random weights with --ignore-eos would give every response MAX_NEW tokens (no tail): they
# draw each response's length from LENGTHS instead (`rollout --response-lengths`), by default
# a long-tailed log-normal set (median MEDIAN tokens, log-sd SIGMA, cut at MAX_NEW; LENGTHS=none:
# every response MAX_NEW tokens). With MODEL the model's own EOS ends responses.
# Expects the release binaries (tandem, pipeline and the stages) in $D. Ends with one table:
# run, placement, mode, s/step, tok/s/GPU, transfer GB/s, mean response length.
set -u
D=${D:-.device}
T=$D/tandem
N=${N:-4}
DEVICE=${DEVICE:-cuda}
SHAPE=${SHAPE:-1.5b}
PLACEMENTS=${PLACEMENTS:-1+3 2+2}
STEPS=${STEPS:-4}
PER_GPU=${PER_GPU:-32}
MAX_NEW=${MAX_NEW:-2048}
MODES=${MODES:-sync one-step-off async}
MEDIAN=${MEDIAN:-400}
SIGMA=${SIGMA:-0.8}
ROUND=${ROUND:-256}
K=${K:-1}
OUT=${OUT:-/tmp/gpu_async}
W=${W:-/tmp/gpu_async_work}
mkdir -p "$OUT" "$W"
export NCCL_NVLS_ENABLE=0
if [ "$DEVICE" = cuda ]; then
  GPUS=$(nvidia-smi -L | wc -l)
  [ "$N" -le "$GPUS" ] || { echo "N=$N but $GPUS GPU(s)"; exit 2; }
fi
# The random model of SHAPE (made on first use), or MODEL.
model() {
  [ -n "${MODEL:-}" ] && { echo "$MODEL"; return; }
  local m=$W/$SHAPE args
  case $SHAPE in
  tiny) args="--layers 2 --hidden 64 --heads 4 --kv-heads 2 --ffn 128 --vocab 300" ;;
  0.5b) args="--layers 24 --hidden 896 --heads 14 --kv-heads 2 --ffn 4864 --vocab 151936 --tie true" ;;
  1.5b) args="--layers 28 --hidden 1536 --heads 12 --kv-heads 2 --ffn 8960 --vocab 151936 --tie true" ;;
  7b) args="--layers 28 --hidden 3584 --heads 28 --kv-heads 4 --ffn 18944 --vocab 152064 --tie false" ;;
  *) echo "SHAPE: unknown shape $SHAPE (tiny, 0.5b, 1.5b, 7b)" >&2; exit 2 ;;
  esac
  # shellcheck disable=SC2086
  [ -f "$m/config.json" ] || $T init-model --like qwen2 $args --seed 1 --out "$m" > /dev/null
  echo "$m"
}
prompts() {
  [ -n "${PROMPTS:-}" ] && { echo "$PROMPTS"; return; }
  [ -f "$W/add.parquet" ] || $T prepare synth --task add --digits 3 --n 4096 --seed 1 \
    --out "$W/add.parquet" > /dev/null
  echo "$W/add.parquet"
}
# The recorded response lengths random weights play (none with MODEL or LENGTHS=none).
lengths() {
  [ -n "${MODEL:-}" ] || [ "${LENGTHS:-}" = none ] && return
  [ -n "${LENGTHS:-}" ] && { echo "$LENGTHS"; return; }
  python3 - "$W/lengths.txt" "$MEDIAN" "$SIGMA" "$MAX_NEW" <<'PY'
import math, random, sys
path, median, sigma, most = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
r = random.Random(1)
with open(path, "w") as f:
    f.write(f"# log-normal: median {median}, log-sd {sigma}, at most {most}\n")
    for _ in range(4096):
        f.write(f"{max(1, min(most, round(median * math.exp(sigma * r.gauss(0, 1)))))}\n")
PY
  echo "$W/lengths.txt"
}
# The spec: FILE MODEL PROMPTS, then the lines of its [placement] (none: colocated).
spec() {
  local eos lens
  eos=$([ -n "${MODEL:-}" ] && echo false || echo true)
  lens=$(lengths)
  [ -n "$lens" ] && lens="response-lengths = \"$lens\""
  cat > "$1" <<EOF
seed = 1
steps = $STEPS
device = "$DEVICE"
gpus = $N
daemon = true
[model]
path = "$2"
[data]
train = "$3"
prompts-per-step = $((PER_GPU * N))
[rollout]
n = 8
max-new-tokens = $MAX_NEW
ignore-eos = $eos
$lens
max-prompt-tokens = 256
raw-prompt = true
[score]
reward = "exact"
[advantage]
estimator = "grpo"
[update]
lr = 0.000001
rollout-is = "token"
$4
EOF
}
m=$(model) || exit 2
p=$(prompts)
rows=()
run() {
  local name=$1 placement=$2 mode=$3 table=$4
  spec "$W/$name.toml" "$m" "$p" "$table"
  rm -rf "$W/run_$name"
  TANDEM_BIN_DIR=$D $D/pipeline run "$W/$name.toml" --run-dir "$W/run_$name" > "$OUT/$name.log" 2>&1
  echo "pipeline $name rc=$?"
  cp "$W/run_$name/metrics.jsonl" "$OUT/$name.jsonl" 2> /dev/null
  cp "$W/run_$name/"*daemon.log "$OUT/" 2> /dev/null
  rows+=("$(python3 - "$OUT/$name.jsonl" "$N" "$name" "$placement" "$mode" <<'PY'
import json, sys
path, gpus, name, placement, mode = sys.argv[1], int(sys.argv[2]), *sys.argv[3:]
try:
    lines = [json.loads(l) for l in open(path)]
except OSError:
    lines = []
later = lines[1:] or lines
if not later:
    print(f"{name} {placement} {mode} - - - -")
    sys.exit()
secs = sum(l["time/step"] for l in later) / len(later)
toks = sum(l["perf/tokens_per_s"] * l["time/step"] for l in later) / sum(l["time/step"] for l in later)
gbs = [l["transfer/gb_per_s"] for l in later if "transfer/gb_per_s" in l]
gb = f"{sum(gbs) / len(gbs):.2f}" if gbs else "-"
lens = sum(l["response_length/mean"] for l in later) / len(later)
print(f"{name} {placement} {mode} {secs:.2f} {toks / gpus:.0f} {gb} {lens:.0f}")
PY
)")
  rm -rf "$W/run_$name"
}
run colocated "$N" colocated ""
for pl in $PLACEMENTS; do
  r=${pl%+*}
  t=${pl#*+}
  [ $((r + t)) -le "$N" ] || { echo "placement $pl needs $((r + t)) GPUs, N=$N"; continue; }
  roll=$(seq -s, 0 $((r - 1)))
  train=$(seq -s, "$r" $((r + t - 1)))
  for mode in $MODES; do
    keys=""
    [ "$mode" = async ] && keys="max-staleness = $K
round-tokens = $ROUND"
    run "${mode}_$pl" "$pl" "$mode" "[placement]
rollout-gpus = [$roll]
train-gpus = [$train]
mode = \"$mode\"
$keys"
  done
done
echo
echo "run placement mode s/step tok/s/GPU transfer_GB/s response_len"
printf '%s\n' "${rows[@]}" | column -t
