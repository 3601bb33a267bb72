#!/usr/bin/env bash
# The main job (`make demo`): GRPO on one-digit addition with a small random model, on CPU, no
# download. Data -> random model -> short SFT warm start on reference answers -> GRPO run of
# pipelines/demo.toml -> plot. Usage: pipelines/demo.sh BIN_DIR WORK_DIR [pipeline run args...]
# (the test suite runs the same script with fewer steps).
set -euo pipefail
bin=$1 work=$2
shift 2
spec=$(cd "$(dirname "$0")" && pwd)/${DEMO_SPEC:-demo.toml}
mkdir -p "$work"
cd "$work"
"$bin/tandem" prepare synth --task add --digits 1 --n 2000 --seed 1 --out data/add-train.parquet
"$bin/tandem" prepare synth --task add --digits 1 --n 200 --seed 2 --split test --out data/add-val.parquet
"$bin/tandem" init-model --like qwen2 --layers 2 --hidden 128 --heads 4 --kv-heads 2 --ffn 384 \
    --vocab 512 --seed 0 --force --out models/base
"$bin/tandem" sft-batch --model models/base --in data/add-train.parquet --raw-prompt --out models/sft.parquet
# One short SFT epoch: the model learns the answer format but not yet the sums (eval ~0.1).
"$bin/update" --model models/base --in models/sft.parquet --out-model models/sft --loss sft \
    --lr 0.001 --mini-batch-size 64 --ppo-epochs 1 --metrics models/sft-metrics.json
"$bin/pipeline" run "$spec" --run-dir run "$@"
"$bin/tandem" plot run
echo "demo: run directory $(pwd)/run (metrics.jsonl, eval.jsonl, plot.png)"
