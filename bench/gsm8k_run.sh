#!/bin/bash
# GSM8K training runs on one lent GPU (docs/GSM8K_RUN.md), for either model, in device calls of
# under 10 minutes, with a report anyone can compare: greedy accuracy on the whole test set
# (1,319 questions) at the spec's evaluation steps and at the end, the step-time split from
# metrics.jsonl, peak GPU memory, and the wall time of every call (evaluations, daemon starts
# and resumes included).
#
# Variables (all steps):
#   STEP   pack | wheels | setup | piece | import | run | start | wait | eval | report   (below)
#   MODEL  0.5b (default) or 1.5b: the GGUF (size, sha256), models/qwen2.5-coder-$MODEL
#   SPEC   pipeline spec [pipelines/gsm8k-qwen2.5-coder-$MODEL-dapo-cuda.toml]; the GRPO one is
#          pipelines/gsm8k-qwen2.5-coder-0.5b-cuda.toml
#   TOOLS  1: the spec with the Python tool [pipelines/gsm8k-qwen2.5-coder-$MODEL-tools-cuda.toml;
#          the code format's is ...-1.5b-code-cuda.toml], and STEP=eval evaluates with that
#          spec's evaluation flags (the tool, its limits and the system prompt) unless
#          EVAL_FLAGS is given
#   AGENT  with TOOLS=1, issue 39's comparison (docs/SERVING.md): 1 picks the agent spec
#          [pipelines/gsm8k-qwen2.5-coder-$MODEL-agent-cuda.toml: pipelines/serve_agent.py
#          plays each step's episodes through the OpenAI API], builtin its twin
#          [...-agent-builtin-cuda.toml: the built-in multi-turn rollout], which differs in
#          `[rollout] agent` only. A spec with an agent needs the `openai` package: when
#          `import openai` fails, STEP=run unpacks the wheels of STEP=wheels (carried in
#          $D/openai-wheels, copied by STEP=setup) into $R/pylib and puts it on PYTHONPATH
#   RUN    run name [gsm8k-$MODEL]: the run directory is $R/runs/$RUN
#   D      carried directory with bin.tar.xz and the GSM8K parquets [.device/rl]
#   P      carried directory with this call's GGUF piece(s) [.device/piece]
#   R      work directory on the device [/root/rl]
#   GPU    the GPU this run uses (CUDA_VISIBLE_DEVICES) [all; one-GPU specs take GPU 0]: two runs
#          of different specs go side by side on a machine of two GPUs (import first, below)
#
# Here (the development machine), once per model:
#   STEP=pack MODEL=1.5b bash bench/gsm8k_run.sh
#     builds the release binaries, makes data/ and the GGUF (make data model-...), and writes
#     .device/rl/{bin.tar.xz,train.parquet,test.parquet} and .device/pieces-$MODEL/q.NN (`split`
#     of the GGUF in pieces of 55 MiB for 0.5b (9) and 52 MiB for 1.5b (21), the last of each
#     short). A call carries at most 64 MiB with the working tree (about 9 MB), so each piece travels in its
#     own call: copy it alone into .device/piece/ before the call. Both models can go to one machine (their pieces and GGUFs
#     are kept apart by MODEL): the setup call can carry one model's short last piece (27 MB of
#     1.5b, 30 MB of 0.5b) beside the binaries.
#   STEP=wheels bash bench/gsm8k_run.sh   (for AGENT=1, once; needs the network)
#     writes $D/openai-wheels: the `openai` client and its dependencies as pure-Python wheels
#     (1.2 MB), which the setup call carries with the binaries
# On the device (the device tool's `run`, carry [".device/rl", ".device/piece"]):
#   STEP=setup  unpack the binaries and data into $R, keep the carried pieces (carry the last,
#               short ones here: they fit beside bin.tar.xz; q.NN of 0.5b as 0.5b-q.NN, of 1.5b
#               as 1.5b-q.NN, or plain q.NN for MODEL's)
#   STEP=piece  keep the carried piece(s) in $R/pieces-$MODEL/ (a repeated call just rewrites them)
#   STEP=import join the pieces into the GGUF once all are there, check its size and sha256 and
#               import it (done by STEP=run too; call it once before starting runs side by side)
#   STEP=run    import (above) if not done, then run or resume the pipeline for at most SECS
#               seconds [480] up to STEPS steps [the spec's]; EVAL_EVERY=K evaluates every K
#               steps instead of the spec's [eval] every (set it at the run's first call: a
#               run continues only with the spec it began with); LR=X sets [update] lr (same
#               rule); GPUS=N runs it on N GPUs of
#               the machine (the spec with gpus = N, same global batch; same rule). Appends the call's wall time
#               to $R/wall-$RUN.tsv and samples GPU memory every 0.5 s.
#   STEP=start  STEP=run detached (setsid): it goes on after the call returns, while the machine
#               stays warm, so one run of up to ~25 minutes needs no restarts (each restart
#               costs the daemon's start and a checkpoint); SECS bounds it [480]
#   STEP=wait   wait up to WAIT seconds [540] while any run of RUNS ["$RUN"] is running, then
#               print each one's last steps and evaluations, and write each one's report (below)
#               into $OUT, so that every call brings the results so far home (keep the machine warm with
#               back-to-back wait calls, then STEP=report)
#   STEP=eval   greedy evaluation of the run's current policy on the whole test set (the spec's
#               evaluation flags: EVAL_FLAGS ["--n 1 --top-k 1 --max-new-tokens 512
#               --max-prompt-tokens 256 --max-num-seqs 768"]), for a run stopped between
#               evaluations; its wall time is counted too
#   STEP=report (into $OUT/report-$RUN.tgz; report.md printed) every evaluation rescored with the built-in rules (strict `#### N`, flexible last
#               number, `\boxed{}`), the step-time split (medians of metrics.jsonl's time/*,
#               with and without the optimizer-checkpoint steps), dynamic sampling's rounds,
#               peak GPU memory and the total wall time, into $OUT/report.md with metrics.jsonl,
#               eval.jsonl, evals.tsv and plot.png
# The run directory lives on the device only while the machine stays warm, and a machine goes
# back after 30 minutes held: pieces, setup and the whole run must fit in one lease.
# Example, 0.5B for 25 minutes of wall time: setup (with q.09), 9 piece calls (q.00..q.08),
#   STEP=import, then STEP=start STEPS=400 SECS=1500 EVAL_EVERY=20, back-to-back STEP=wait
#   calls, STEP=report.
set -u
MODEL=${MODEL:-0.5b}
case "$MODEL" in
0.5b) GGUF_NAME=Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf; BYTES=491400064; PIECE=55M
      SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 ;;
1.5b) GGUF_NAME=Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf; BYTES=1117320768; PIECE=52M
      SHA=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 ;;
*) echo "MODEL=$MODEL: expected 0.5b or 1.5b"; exit 2 ;;
esac
MODEL_DIR=models/qwen2.5-coder-$MODEL
if [ "${TOOLS:-0}" = 1 ] && [ "${AGENT:-0}" = 1 ]; then
  SPEC=${SPEC:-pipelines/gsm8k-qwen2.5-coder-$MODEL-agent-cuda.toml}
elif [ "${TOOLS:-0}" = 1 ] && [ "${AGENT:-0}" = builtin ]; then
  SPEC=${SPEC:-pipelines/gsm8k-qwen2.5-coder-$MODEL-agent-builtin-cuda.toml}
elif [ "${TOOLS:-0}" = 1 ]; then
  SPEC=${SPEC:-pipelines/gsm8k-qwen2.5-coder-$MODEL-tools-cuda.toml}
else
  SPEC=${SPEC:-pipelines/gsm8k-qwen2.5-coder-$MODEL-dapo-cuda.toml}
fi
RUN=${RUN:-gsm8k-$MODEL}
D=${D:-.device/rl}
D_ABS=$(readlink -m "$D")
P=${P:-.device/piece}
R=${R:-/root/rl}
SELF=$(readlink -f "$0")
BINS="tandem pipeline rollout score ref-logprob advantage update sync-weights values"
export TANDEM_CACHE=${TANDEM_CACHE:-/root/tandem-cache} TANDEM_BIN_DIR=$R/bin PYTHONUNBUFFERED=1
SMI_GPU=()
if [ -n "${GPU:-}" ]; then export CUDA_VISIBLE_DEVICES=$GPU; SMI_GPU=(-i "$GPU"); fi

# Appends "what seconds steps_done" to the run's wall-time ledger.
ledger() {
  local done
  done=$(python3 -c "import json; print(json.load(open('runs/$RUN/state.json'))['steps_done'])" 2>/dev/null || echo 0)
  printf '%s\t%s\t%s\n' "$1" "$2" "$done" >> "$R/wall-$RUN.tsv"
}

# Samples the GPU's used memory (MiB) every 0.5 s into $1 until stop_mem.
start_mem() {
  nvidia-smi "${SMI_GPU[@]}" --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >> "$1" 2>/dev/null &
  MEM_PID=$!
}
stop_mem() { kill "$MEM_PID" 2>/dev/null; wait "$MEM_PID" 2>/dev/null; }

# The `openai` package for a spec's agent (pipelines/serve_agent.py): the machine's own, else
# the carried wheels (pure Python, any python3 >= 3.10) unpacked into $R/pylib, offline.
need_openai() {
  python3 -c 'import openai' 2>/dev/null && return 0
  local whl=$R/openai-wheels
  [ -d "$whl" ] || whl=$D_ABS/openai-wheels
  ls "$whl"/*.whl > /dev/null 2>&1 || { echo "no openai on this machine and no wheels in $R/openai-wheels or $D_ABS/openai-wheels: run STEP=wheels here and carry $D"; return 1; }
  python3 -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
    "$R/pylib" "$whl"/*.whl || return 1
  export PYTHONPATH=$R/pylib${PYTHONPATH:+:$PYTHONPATH}
  python3 -c 'import openai; print("openai", openai.__version__, "from", openai.__file__)'
}

case "${STEP:-}" in
pack)
  set -e
  make build data "model-qwen2.5-coder-$MODEL"
  mkdir -p "$D" ".device/pieces-$MODEL" .device/piece
  tmp=$(mktemp -d)
  for b in $BINS; do cp "target/release/$b" "$tmp/"; strip "$tmp/$b"; done
  # xz -9: a 64 MiB window, so the stage binaries after the first cost little (the setup call
  # carries them with the short last pieces of both models).
  tar -cf - -C "$tmp" $BINS | xz -9 -T2 > "$D/bin.tar.xz" && rm -rf "$tmp"
  cp data/gsm8k/train.parquet data/gsm8k/test.parquet "$D/"
  rm -f ".device/pieces-$MODEL"/q.*
  split -b "$PIECE" -d -a 2 ".cache/models/$GGUF_NAME" ".device/pieces-$MODEL/q."
  ls -la "$D" ".device/pieces-$MODEL"
  echo "pieces: $(ls ".device/pieces-$MODEL" | wc -l); carry the last with STEP=setup, the others one per STEP=piece call"
  ;;
wheels)
  # Here, with network: the `openai` client and its dependencies as pure-Python wheels (about
  # 1.2 MB), so that one set serves whatever python3 the device has: openai 1.39 is the last
  # without the compiled `jiter`, pydantic 1.10 has a pure wheel, httpx 0.28 drops what that
  # openai passes.
  set -e
  rm -rf "$D/openai-wheels" && mkdir -p "$D/openai-wheels"
  pip download "openai==1.39.0" "httpx==0.27.2" "pydantic<2" --only-binary=:all: --platform any \
    --python-version 3.10 --implementation py -d "$D/openai-wheels" -q
  du -sh "$D/openai-wheels"
  ;;
setup)
  rm -rf "$R" && mkdir -p "$R/bin" "$R/data/gsm8k" "$R/pipelines/rewards" "$R/pieces-0.5b" "$R/pieces-1.5b"
  tar -xJf "$D/bin.tar.xz" -C "$R/bin" && cp "$D"/train.parquet "$D"/test.parquet "$R/data/gsm8k/" || exit 1
  [ -d "$D/openai-wheels" ] && cp -r "$D/openai-wheels" "$R/"
  cp "$P"/q.* "$R/pieces-$MODEL/" 2>/dev/null
  for m in 0.5b 1.5b; do
    for f in "$P/$m"-q.*; do [ -f "$f" ] && cp "$f" "$R/pieces-$m/${f##*/$m-}"; done
  done
  ls -la "$R/bin" "$R"/pieces-*
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
  ;;
piece)
  mkdir -p "$R/pieces-$MODEL" && cp "$P"/q.* "$R/pieces-$MODEL/" && ls "$R/pieces-$MODEL" | tr '\n' ' ' && echo
  ;;
import|run)
  cp pipelines/*.toml pipelines/serve_agent.py "$R/pipelines/" && cp pipelines/rewards/*.py "$R/pipelines/rewards/"
  [ -f "$SPEC" ] || { echo "SPEC=$SPEC: no such spec"; exit 2; }
  cd "$R" || exit 1
  gguf=model-$MODEL.gguf
  if [ ! -f "$gguf" ]; then
    have=$(cat "pieces-$MODEL"/q.* 2>/dev/null | wc -c)
    [ "$have" = "$BYTES" ] || { echo "pieces hold $have of $BYTES bytes: carry the missing ones (STEP=piece)"; ls "pieces-$MODEL"; exit 1; }
    cat "pieces-$MODEL"/q.* > "$gguf.tmp" && mv "$gguf.tmp" "$gguf" && rm -rf "pieces-$MODEL"
  fi
  echo "$SHA  $gguf" | sha256sum -c --quiet || exit 1
  if [ ! -d "$MODEL_DIR" ]; then
    t0=$SECONDS
    bin/tandem import-gguf "$gguf" --out "$MODEL_DIR" || exit 1
    ledger import $((SECONDS - t0))
  fi
  [ "$STEP" = import ] && exit 0
  if grep -q '^agent = ' "$SPEC"; then need_openai || exit 1; fi
  spec=$SPEC
  if [ -n "${EVAL_EVERY:-}${GPUS:-}${LR:-}" ]; then
    spec=pipelines/$RUN.toml
    if [ ! -f "runs/$RUN/state.json" ]; then
      cp "$SPEC" "$spec"
      [ -z "${EVAL_EVERY:-}" ] || sed -i "/^\[eval\]/,/^\[/ s/^every = .*/every = $EVAL_EVERY/" "$spec"
      [ -z "${LR:-}" ] || sed -i "/^\[update\]/,/^\[/ s/^lr = .*/lr = $LR/" "$spec"
      # gpus = N at the top level (before the first table): data-parallel stages on a daemon group.
      [ -z "${GPUS:-}" ] || sed -i "0,/^\[/ s/^\[/gpus = $GPUS\n[/" "$spec"
    fi
  elif [ -f "pipelines/$RUN.toml" ]; then
    spec=pipelines/$RUN.toml
  fi
  # The spec this run started with, for STEP=report's title (a later call may not pass SPEC;
  # a report while the run goes on has no spec-source.txt yet).
  [ -f "$R/spec-$RUN.txt" ] || echo "$SPEC" > "$R/spec-$RUN.txt"
  t0=$SECONDS
  start_mem "$R/mem-$RUN.csv"
  steps=()
  [ -n "${STEPS:-}" ] && steps=(--steps "$STEPS")
  timeout -s INT "${SECS:-480}" bin/pipeline run "$spec" --run-dir "runs/$RUN" "${steps[@]}" \
    >> "$R/pipeline-$RUN.log" 2>&1
  rc=$?
  stop_mem
  # The spec this run started with, for STEP=report's title (a later call may not pass SPEC).
  [ -d "runs/$RUN" ] && [ ! -f "runs/$RUN/spec-source.txt" ] && echo "$SPEC" > "runs/$RUN/spec-source.txt"
  # The runner's daemon and stages die with it (PR_SET_PDEATHSIG); give the GPU a moment.
  sleep 2
  ledger run $((SECONDS - t0))
  echo "pipeline rc=$rc in $((SECONDS - t0)) s; steps done: $(grep -o '"steps_done": *[0-9]*' "runs/$RUN/state.json")"
  grep -E '^(step|eval step) ' "$R/pipeline-$RUN.log" | tail -6
  [ -d "${OUT:-}" ] && tail -c 8000 "$R/pipeline-$RUN.log" > "$OUT/pipeline-$RUN.log"
  ;;
start)
  mkdir -p "$R"
  # Before detaching, so that a missing package shows in this call (the run inherits PYTHONPATH).
  if [ -f "$SPEC" ] && grep -q '^agent = ' "$SPEC"; then need_openai || exit 1; fi
  STEP=run OUT= setsid nohup bash "$SELF" > "$R/start-$RUN.log" 2>&1 < /dev/null &
  echo "started $RUN (pid $!, at most ${SECS:-480} s): $R/pipeline-$RUN.log"
  ;;
wait)
  cd "$R" || exit 1
  live() {
    local r
    for r in ${RUNS:-$RUN}; do
      [ -f "runs/$r/lock" ] && kill -0 "$(cat "runs/$r/lock")" 2>/dev/null && return 0
    done
    return 1
  }
  t0=$SECONDS
  # A run's lock appears a moment after its start.
  sleep 5
  while live && [ $((SECONDS - t0)) -lt "${WAIT:-540}" ]; do sleep 5; done
  for r in ${RUNS:-$RUN}; do
    echo "== $r: $(live && echo running || echo stopped) after $((SECONDS - t0)) s"
    grep -E '^(step|eval step) ' "$R/pipeline-$r.log" | tail -4
    grep -E 'eval acc' "$R/pipeline-$r.log" | tail -12 | cut -c1-160
    # Each call brings the report home: a machine that goes back between calls (30 s without
    # one) takes the run directory with it.
    [ -d "${OUT:-}" ] && STEP=report RUN=$r bash "$SELF" > "$OUT/report-$r.log" 2>&1
  done
  ;;
eval)
  cd "$R" || exit 1
  dir=runs/$RUN/final-eval
  mkdir -p "$dir"
  flags=${EVAL_FLAGS:---n 1 --top-k 1 --max-new-tokens 512 --max-prompt-tokens 256 --max-num-seqs 768}
  if [ "${TOOLS:-0}" = 1 ] && [ -z "${EVAL_FLAGS:-}" ]; then
    # The spec's evaluation command as its dry run prints it (shell-quoted): its flags after
    # `--out FILE`, up to the seed.
    line=$(bin/pipeline run "$SPEC" --dry-run --steps 1 --run-dir "$(mktemp -u -d)" 2>/dev/null \
      | grep '/rollout .* --top-k 1 ' | tail -1)
    rest=${line#* --out }
    rest=${rest#* }
    flags=${rest%% --seed *}
    [ -n "$line" ] || { echo "no evaluation command in the dry run of $SPEC"; exit 1; }
  fi
  eval "flags=($flags)"
  t0=$SECONDS
  bin/rollout --model "runs/$RUN/policy" --in data/gsm8k/test.parquet --out "$dir/rollout.parquet" \
    --device cuda "${flags[@]}" > "$dir/rollout.log" 2>&1 || { tail -5 "$dir/rollout.log"; exit 1; }
  ledger eval $((SECONDS - t0))
  echo "final evaluation of $(python3 -c "import json; print(json.load(open('runs/$RUN/policy'))['policy_version'])") in $((SECONDS - t0)) s"
  ;;
report)
  cd "$R" || exit 1
  run=runs/$RUN
  FINAL_OUT=$OUT
  OUT=$(mktemp -d)
  # Every evaluation (and the final one) rescored with the built-in rules.
  printf 'step\tstrict\tflexible\tboxed\n' > "$OUT/evals.tsv"
  for d in "$run"/eval/step-* "$run"/final-eval; do
    [ -f "$d/rollout.parquet" ] || continue
    row=$(basename "$d")
    for rule in "gsm8k --gsm8k-method strict" "gsm8k --gsm8k-method flexible" "math"; do
      # shellcheck disable=SC2086
      bin/score --in "$d/rollout.parquet" --out /tmp/rescored.parquet --reward $rule \
        --metrics /tmp/rescored.json > /dev/null 2>&1
      row="$row\t$(python3 -c "import json; print(json.load(open('/tmp/rescored.json'))['score/accuracy'])")"
    done
    printf "$row\n" >> "$OUT/evals.tsv"
  done
  cp "$run/metrics.jsonl" "$run/eval.jsonl" "$OUT/" 2>/dev/null
  bin/tandem plot "$run" --out "$OUT/plot.png" > /dev/null 2>&1
  spec_ran=$(cat "$run/spec-source.txt" "$R/spec-$RUN.txt" 2>/dev/null | head -1)
  spec_ran=${spec_ran:-$SPEC}
  # The model the run trained, from its spec's name (a wait over runs of both models).
  model=$MODEL
  case "$spec_ran" in *0.5b*) model=0.5b ;; *1.5b*) model=1.5b ;; esac
  python3 - "$run" "$R/wall-$RUN.tsv" "$R/mem-$RUN.csv" "$OUT/evals.tsv" "$model" "$spec_ran" > "$OUT/report.md" <<'EOF'
import json, os, re, statistics, sys
run, wall, mem, evals, model, spec = sys.argv[1:]
try:
    lines = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
except OSError:
    lines = []
# The step's time without its evaluation (time/step counts both).
for l in lines:
    l["time/train"] = l.get("time/step", 0) - sum(v for k, v in l.items() if k.startswith("time/eval-"))
print(f"# GSM8K, Qwen2.5-Coder-{model.upper()}-Instruct: {spec}, {len(lines)} steps\n")
print("## Greedy accuracy, whole test set (1,319 questions)\n")
print("| eval | strict `#### N` | flexible (last number) | `\\boxed{}` |\n|---|---|---|---|")
for row in list(open(evals))[1:]:
    name, *acc = row.split()
    print(f"| {name} | " + " | ".join(f"{100 * float(a):.1f}%" for a in acc) + " |")
def median_split(rows, title):
    keys = sorted({k for l in rows for k in l if k.startswith("time/")})
    if not rows:
        print(f"\n{title}: none")
        return
    print(f"\n{title} ({len(rows)} steps, median seconds)\n")
    print("| " + " | ".join(k[5:] for k in keys) + " |\n|" + "---|" * len(keys))
    print("| " + " | ".join(f"{statistics.median(l[k] for l in rows if k in l):.2f}" for k in keys) + " |")
print("\n## Step time\n\n`train` is `step` without the evaluation's rollout and score.")
median_split(lines, "All steps")
median_split([l for l in lines if not l.get("update/optimizer_state_saved")], "Steps without an optimizer checkpoint")
if any("sampling/rounds" in l for l in lines):
    r = [l["sampling/rounds"] for l in lines]
    print(f"\nDynamic sampling: {statistics.mean(r):.2f} rounds per step (max {max(r)}), "
          f"{statistics.mean(l['sampling/groups_dropped'] for l in lines):.1f} groups dropped, "
          f"{sum(l['sampling/capped'] for l in lines)} steps capped, "
          f"{sum(l['sampling/prompts'] for l in lines)} prompts drawn")
# The rollout's throughput, measured alike for the built-in rollout and an agent's step (issue
# 39's comparison): a step's response tokens (tool results included) over the rollout's wall
# time (an agent step's: serving, the agent's episodes and the collecting).
try:
    text = open(spec).read()
    samples = (int(re.search(r"^n = (\d+)", text, re.M)[1])
               * int(re.search(r"^prompts-per-step = (\d+)", text, re.M)[1]))
    if re.search(r"^filter-groups = true", text, re.M):
        samples = None  # dynamic sampling plays a varying number of rounds
except (OSError, TypeError):
    samples = None
r = [l for l in lines if l.get("time/rollout") and "response_length/mean" in l]
if samples and r:
    tps = [l["response_length/mean"] * samples / l["time/rollout"] for l in r]
    print(f"\n## Rollout throughput\n\n{samples} samples a step; medians over {len(r)} steps: "
          f"{statistics.median(l['time/rollout'] for l in r):.2f} s of rollout, "
          f"{statistics.median(l['response_length/mean'] for l in r):.0f} response tokens a sample, "
          f"**{statistics.median(tps):.0f} response tokens/s** (tool results included); "
          f"{statistics.median(l['time/step'] for l in r):.2f} s a step")
    g = [l["rollout/generation_tokens_per_s"] for l in r if "rollout/generation_tokens_per_s" in l]
    if g:
        print(f"(the engine's own generation rate, built-in rollout only: {statistics.median(g):.0f} tokens/s)")
# A spec that offers tools (every rollout reports tool_calls, 0 without tools).
if ("tools" in spec or "-code-" in spec) and any("rollout/tool_calls" in l for l in lines):
    t = [l for l in lines if "rollout/tool_calls" in l]
    calls = sum(l["rollout/tool_calls"] for l in t)
    print(f"\nTools (training rollouts): {statistics.mean(l['rollout/tool_calls_per_sample'] for l in t):.2f} calls per answer, "
          f"{statistics.mean(l['rollout/turns_mean'] for l in t):.2f} turns, "
          f"{sum(l['rollout/tool_errors'] for l in t)} of {calls} calls with an error; median seconds a step: "
          f"{statistics.median(l.get('rollout/generation_seconds', 0) for l in t):.2f} generation, "
          f"{statistics.median(l.get('rollout/tool_wait_seconds', 0) for l in t):.2f} waiting for tools, "
          f"{statistics.median(l.get('time/update', 0) for l in t):.2f} update")
try:
    peak = max(int(x) for x in open(mem) if x.strip().isdigit())
    print(f"\nPeak GPU memory used (nvidia-smi, every 0.5 s): {peak / 1024:.1f} GiB")
except (OSError, ValueError):
    pass
print("\n## Wall time\n\n| call | seconds | steps done after |\n|---|---|---|")
total = 0
# A run still going has no ledger line yet (STEP=run writes it at its end).
for row in (open(wall) if os.path.exists(wall) else []):
    what, secs, done = row.split()
    total += int(secs)
    print(f"| {what} | {secs} | {done} |")
print(f"\nTotal: {total} s = {total / 60:.1f} min (the calls' own time: evaluations, daemon starts and resumes included; the gaps between calls are not)")
EOF
  cp "$R/pipeline-$RUN.log" "$R/wall-$RUN.tsv" "$OUT/" 2>/dev/null
  tar -czf "$FINAL_OUT/report-$RUN.tgz" -C "$OUT" . && rm -rf "$OUT"
  tar -xzOf "$FINAL_OUT/report-$RUN.tgz" ./report.md
  ;;
*)
  echo "STEP=pack|setup|piece|run|eval|report (see the top of $0)"; exit 2 ;;
esac
