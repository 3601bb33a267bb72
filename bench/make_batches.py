#!/usr/bin/env python3
"""Writes the input batches of the GPU stage checks (run here, carried to the device):
  tiny.parquet   8 rows for `update` / `ref-logprob` on the tiny test model (vocab 300)
  qwen05.parquet 8 rows of random ids for the Qwen2.5-0.5B-shaped log-prob comparison
  qwen05.json    the same token ids, for bench/hf_logprob_compare.py (no pyarrow needed there)
  train05.parquet 64 rows of 128 prompt + 512 response tokens (640 each) for timing `update`
Usage: make_batches.py OUT_DIR"""
import json
import random
import sys

import pyarrow as pa
import pyarrow.parquet as pq


def lst(t):
    # The batch contract's list columns have non-null items.
    return pa.list_(pa.field("item", t, nullable=False))


def batch(path, vocab, n, plen, rlen, rng, vary=1):
    prompts = [[rng.randrange(vocab) for _ in range(plen + i * vary)] for i in range(n)]
    resps = [[rng.randrange(vocab) for _ in range(rlen - 3 * i * vary)] for i in range(n)]
    adv = [[rng.gauss(0.0, 1.0)] * len(r) for r in resps]
    cols = {
        "uid": (pa.string(), [f"u{i}" for i in range(n)]),
        "prompt_uid": (pa.string(), [f"p{i // 2}" for i in range(n)]),
        "prompt_ids": (lst(pa.int32()), prompts),
        "response_ids": (lst(pa.int32()), resps),
        "response_mask": (lst(pa.uint8()), [[1] * len(r) for r in resps]),
        "advantages": (lst(pa.float32()), adv),
    }
    schema = pa.schema([pa.field(k, t, nullable=False) for k, (t, _) in cols.items()])
    table = pa.table({k: pa.array(v, type=t) for k, (t, v) in cols.items()}, schema=schema)
    pq.write_table(table, path)
    return prompts, resps


def main():
    out = sys.argv[1]
    rng = random.Random(7)
    batch(f"{out}/tiny.parquet", 300, 8, 12, 40, rng)
    prompts, resps = batch(f"{out}/qwen05.parquet", 151936, 8, 64, 192, rng)
    with open(f"{out}/qwen05.json", "w") as f:
        json.dump({"prompts": prompts, "responses": resps}, f)
    batch(f"{out}/train05.parquet", 151936, 64, 128, 512, rng, vary=0)


if __name__ == "__main__":
    main()
