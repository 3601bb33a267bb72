# tandem: the commands a user (and CI) runs. See README.md.
SHELL := /bin/bash
CARGO ?= cargo
SHARED ?= ../shared
GSM8K ?= $(SHARED)/data/gsm8k
BIN := target/release

.PHONY: build test data bench fmt lint

build:
	$(CARGO) build --release

# The test command of a fresh machine (and of CI).
test:
	$(CARGO) test

data: data/gsm8k/train.parquet data/gsm8k/test.parquet

data/gsm8k/%.parquet: $(GSM8K)/%.jsonl build
	$(BIN)/tandem prepare gsm8k --in $< --out $@ --split $*

bench: build
	$(BIN)/tandem bench cpu-stages

fmt:
	$(CARGO) fmt --all

lint:
	$(CARGO) clippy --all-targets -- -D warnings
