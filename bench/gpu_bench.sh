#!/bin/bash
# The GPU benchmarks with their peers, in one device call (each part under a few minutes on an H100):
#   rollout   `tandem bench rollout` (paged engine, CUDA graphs, 3 runs per case) + HF `generate` peer
#   update    `tandem bench update` and `tandem bench logprob` + the PyTorch peer (bench/peer_update.py)
#   grpo      `tandem bench grpo-step` on the daemon (random Qwen2.5-0.5B shape, 64 x 8 x 512)
#             + the PyTorch/HF peer step (bench/peer_grpo_step.py)
# Usage (from the repo root on the GPU machine; $OUT is where logs and JSON go):
#   D=.device bench/gpu_bench.sh                      # D holds the stripped release `tandem` and
#                                                     # prompts.parquet (tandem prepare gsm8k)
#   D=.device BASE=.device/base bench/gpu_bench.sh    # also another build (e.g. the tree before a
#                                                     # change), run alternately in the same call
#   PARTS="rollout update" PEERS=0 ...                # a subset; no peers
# Ends with one table: part, build, metric, value. The peers need python3 with torch and
# transformers (the GPU machine has them).
set -u
D=${D:-.device}
BASE=${BASE:-}
PARTS=${PARTS:-rollout update grpo}
PEERS=${PEERS:-1}
OUT=${OUT:-/tmp/gpu_bench}
mkdir -p "$OUT"
export TANDEM_CACHE=${TANDEM_CACHE:-/root/tandem-cache} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
builds="new=$D/tandem"
[ -n "$BASE" ] && builds="base=$BASE/tandem $builds"
t0=$SECONDS
json_last() { tail -1 "$1"; }

for part in $PARTS; do
  case $part in
  rollout)
    for b in $builds; do
      name=${b%%=*}; bin=${b#*=}
      $bin bench rollout --device cuda --modes graphs --runs 3 > "$OUT/rollout_$name.txt" 2>&1
      echo "bench rollout [$name] rc=$?"
    done
    if [ "$PEERS" = 1 ]; then
      python3 bench/peer_generate.py > "$OUT/peer_generate.txt" 2>&1
      echo "peer generate rc=$?"
    fi
    ;;
  update)
    for b in $builds; do
      name=${b%%=*}; bin=${b#*=}
      $bin bench update --json "$OUT/update_$name.json" > "$OUT/update_$name.txt" 2>&1
      echo "bench update [$name] rc=$?"
      $bin bench logprob --json "$OUT/logprob_$name.json" > "$OUT/logprob_$name.txt" 2>&1
      echo "bench logprob [$name] rc=$?"
    done
    if [ "$PEERS" = 1 ]; then
      python3 bench/peer_update.py 3 > "$OUT/peer_update.txt" 2>&1; echo "peer update rc=$?"
      python3 bench/peer_update.py 3 --logprob > "$OUT/peer_logprob.txt" 2>&1; echo "peer logprob rc=$?"
    fi
    ;;
  grpo)
    for b in $builds; do
      name=${b%%=*}; bin=${b#*=}
      rm -rf /tmp/q05g /tmp/grpo_$name
      $bin init-model --like qwen2 --layers 24 --hidden 896 --heads 14 --kv-heads 2 --ffn 4864 \
        --vocab 151936 --tie true --rope-theta 1000000 --rms-norm-eps 1e-6 --seed 1 --out /tmp/q05g > /dev/null
      $bin bench grpo-step --device cuda --model /tmp/q05g --prompts "$D/prompts.parquet" --raw-prompt \
        --work /tmp/grpo_$name --prompts-per-step 64 --n 8 --max-new-tokens 512 --mini-batches 4 \
        --steps 4 --modes daemon ${GRPO_ARGS:-} > "$OUT/grpo_$name.txt" 2>&1
      echo "bench grpo-step [$name] rc=$?"
      rm -rf /tmp/grpo_$name
    done
    if [ "$PEERS" = 1 ]; then
      python3 bench/peer_grpo_step.py 64 8 512 > "$OUT/peer_grpo.json" 2> "$OUT/peer_grpo.err"
      echo "peer grpo rc=$?"
    fi
    ;;
  esac
done

python3 - "$OUT" <<'PY'
import json, os, re, sys
out = sys.argv[1]
rows = []
def last_json(path):
    try:
        for line in reversed(open(path).read().splitlines()):
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)
    except (OSError, ValueError):
        return None
for name in ("base", "new"):
    j = last_json(f"{out}/rollout_{name}.txt")
    if j:
        for c in j["cases"]:
            if c["run"] >= 2:  # later runs: what a daemon's RL steps cost
                rows.append(("rollout", name, f"{c['case']} run {c['run']} tok/s", f"{c['tokens_per_s']:.0f}"))
    for what in ("update", "logprob"):
        try:
            j = json.load(open(f"{out}/{what}_{name}.json"))
            rows.append((what, name, "tok/s", f"{j['tokens_per_s']:.0f}"))
            rows.append((what, name, "MFU %", f"{100 * j['mfu']:.1f}"))
        except (OSError, ValueError, KeyError):
            pass
    j = last_json(f"{out}/grpo_{name}.txt")
    if j:
        later = [r for r in j["results"] if r["step"] >= 2]  # the first step also loads
        for k in ("rollout", "ref_logprob", "old_logprob", "update", "sync", "step"):
            v = sorted(r["seconds"].get(k, 0.0) or 0.0 for r in later)
            if v:
                rows.append(("grpo-step", name, f"median {k} s (steps 2+)", f"{v[len(v) // 2]:.3f}"))
for path, what in (("peer_generate.txt", "rollout"), ("peer_update.txt", "update"), ("peer_logprob.txt", "logprob")):
    try:
        txt = open(f"{out}/{path}").read()
    except OSError:
        continue
    for line in txt.splitlines():
        if "tok/s" in line or "tokens_per_s" in line:
            rows.append((what, "peer", "", line.strip()[:110]))
try:
    rows.append(("grpo-step", "peer", "", open(f"{out}/peer_grpo.json").read().strip()[:110]))
except OSError:
    pass
print(f"{'part':10} {'build':5} {'metric':44} value")
for r in rows:
    print(f"{r[0]:10} {r[1]:5} {r[2]:44} {r[3]}")
PY
echo "done in $((SECONDS - t0)) s"
