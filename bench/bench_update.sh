#!/bin/bash
# On the GPU machine: `tandem bench update` and `tandem bench logprob` (the issue-6 workload:
# Qwen2.5-0.5B shape, random weights, 8 micro-batches of 8 x 640 tokens, PPO-clip + AdamW) and
# the PyTorch peer (peer_update.py, update and --logprob) in the same call, then one comparison
# table. GPU memory is also sampled by nvidia-smi every 100 ms (whole device, context included).
# D: folder with the tandem binary and peer_update.py (default .device/perf); R: results
# folder; VARIANTS=1 also runs update with the host-side loss and with the old 110-row LM-head
# chunks, to show what each change buys.
D=${D:-.device/perf}
R=${R:-/tmp/bench}
T=$D/tandem
rm -rf "$R" && mkdir -p "$R"
export TANDEM_CACHE=${TANDEM_CACHE:-/root/tandem-cache}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
one() {
  local name=$1; shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$R/$name.mem" &
  local p=$!
  "$@" > "$R/$name.out" 2> "$R/$name.err"
  local rc=$?
  kill $p
  echo "$name: rc=$rc, $(tail -1 "$R/$name.err" | cut -c1-150)"
}
one ours_update $T bench update --json "$R/ours_update.json"
one ours_logprob $T bench logprob --json "$R/ours_logprob.json"
if [ "${VARIANTS:-0}" = 1 ]; then
  one ours_update_hostloss env TANDEM_HOST_LOSS=1 $T bench update --json "$R/ours_update_hostloss.json"
  one ours_update_chunk110 $T bench update --logprob-chunk 110 --json "$R/ours_update_chunk110.json"
fi
one peer_update python3 "$D/peer_update.py" 3
one peer_logprob python3 "$D/peer_update.py" 3 --logprob
python3 - "$R" <<'PY'
import json, os, sys
R = sys.argv[1]
def load(name):
    p = os.path.join(R, name + (".json" if name.startswith("ours") else ".out"))
    try:
        txt = open(p).read().strip().splitlines()
        return json.loads(txt[-1] if not name.startswith("ours") else "\n".join(txt))
    except Exception:
        return None
def smi(name):
    try:
        v = [int(x) for x in open(os.path.join(R, name + ".mem")) if x.strip()]
        return max(v) / 1024
    except Exception:
        return float("nan")
rows = []
for bench in ["update", "logprob"]:
    peer = load("peer_" + bench)
    names = ["ours_" + bench] + ([f"ours_update_{v}" for v in ("hostloss", "chunk110")] if bench == "update" else [])
    for n in names + ["peer_" + bench]:
        j = load(n)
        if j is None:
            continue
        own = j["memory"]["pool_peak_in_use_gib"] if n.startswith("ours") else j["peak_mem_gib"]
        ratio = j["tokens_per_s"] / peer["tokens_per_s"] if peer else float("nan")
        rows.append((bench, n, j["tokens_per_s"] / 1e3, 100 * j["mfu"], own, smi(n), ratio))
print(f"{'bench':8} {'run':22} {'ktok/s':>8} {'MFU %':>6} {'own peak GiB':>12} {'smi peak GiB':>12} {'vs peer':>8}")
for r in rows:
    print(f"{r[0]:8} {r[1]:22} {r[2]:8.1f} {r[3]:6.1f} {r[4]:12.2f} {r[5]:12.2f} {r[6]:8.2f}")
PY
