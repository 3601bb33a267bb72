# tandem: the commands a user (and CI) runs. See README.md.
SHELL := /bin/bash
CARGO ?= cargo
SHARED ?= ../shared
GSM8K ?= $(SHARED)/data/gsm8k
BIN := target/release

.PHONY: build test data bench fmt lint gpu-test kernels-check demo

build:
	$(CARGO) build --release

# The test command of a fresh machine (and of CI).
test:
	$(CARGO) test

# The main job: GRPO on one-digit addition with a small random model, on CPU, no download
# (pipelines/demo.sh: data, random model, SFT warm start, pipelines/demo.toml, plot), in runs/demo.
demo: build
	rm -rf runs/demo/run
	pipelines/demo.sh $(CURDIR)/$(BIN) runs/demo $(DEMO_ARGS)

data: data/gsm8k/train.parquet data/gsm8k/test.parquet

data/gsm8k/%.parquet: $(GSM8K)/%.jsonl build
	$(BIN)/tandem prepare gsm8k --in $< --out $@ --split $*

bench: build
	$(BIN)/tandem bench cpu-stages

fmt:
	$(CARGO) fmt --all

lint:
	$(CARGO) clippy --all-targets -- -D warnings

# CUDA parity suite for the lent GPU machine: a stripped release binary in .device/ (ignored by
# git), to be carried there and run as printed. CI builds the CUDA code but cannot run it.
gpu-test:
	$(CARGO) build --release --bin tandem
	mkdir -p .device && cp $(BIN)/tandem .device/tandem
	@grep -qx '/.device/' "$$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null || \
		{ mkdir -p "$$(git rev-parse --git-common-dir)/info" && echo '/.device/' >> "$$(git rev-parse --git-common-dir)/info/exclude"; }
	@echo "device run (carry .device):"
	@echo '  set -o pipefail; .device/tandem gpu-test --json $$OUT/parity.json 2>&1 | tee $$OUT/parity.log'

# Compile every CUDA kernel with NVRTC, no GPU needed: uses the nvidia-cuda-nvrtc wheel of the
# local python when libnvrtc is not already on the library path.
NVRTC_DIR ?= $(shell python3 -c "import nvidia, os; d = [os.path.join(p, s, 'lib') for p in nvidia.__path__ for s in ('cu13', 'cuda_nvrtc')]; print(next((x for x in d if os.path.isdir(x)), ''))" 2>/dev/null)
kernels-check:
	LD_LIBRARY_PATH="$(NVRTC_DIR):$$LD_LIBRARY_PATH" $(CARGO) run --bin tandem -- gpu-test --compile-only
