#!/usr/bin/env python3
"""Compares what bench/gpu_rollout.sh wrote (issue 7): greedy `rollout --device cuda` vs
`--device cpu` (fraction of response positions with the same token, counting every position
after a sample's first disagreement as disagreeing), and rollout_logprobs vs the trainer's
old_logprobs of the same tokens (max |Δ|, fraction of tokens whose ratio exp(Δ) leaves
[0.99, 1.01]). Usage: compare_rollouts.py DIR (the $OUT of gpu_rollout.sh, or results.tgz of
gpu_rollout_bench.sh unpacked)"""
import json
import sys

import numpy as np
import pyarrow.parquet as pq

out = sys.argv[1]
res = {}
cpu = pq.read_table(f"{out}/tiny_greedy_cpu.parquet").column("response_ids").to_pylist()
gpu = pq.read_table(f"{out}/tiny_greedy_cuda.parquet").column("response_ids").to_pylist()
same = total = 0
for a, b in zip(cpu, gpu):
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    same += k
    total += len(a)
res["tiny_greedy_positions_agree"] = same / total
res["tiny_greedy_positions"] = total
for m in ["tiny", "q05", "q05_inv", "q05_agree_scalar"]:
    try:
        t = pq.read_table(f"{out}/{m}.parquet" if m.endswith("scalar") else f"{out}/{m}_agree.parquet")
    except FileNotFoundError:
        continue
    r = np.concatenate([np.array(x, dtype=np.float64) for x in t.column("rollout_logprobs").to_pylist()])
    o = np.concatenate([np.array(x, dtype=np.float64) for x in t.column("old_logprobs").to_pylist()])
    d = r - o
    ratio = np.exp(d)
    res[m] = {
        "tokens": int(d.size),
        "max_abs_delta": float(np.abs(d).max()),
        "mean_abs_delta": float(np.abs(d).mean()),
        "frac_ratio_outside_0.99_1.01": float(np.mean((ratio < 0.99) | (ratio > 1.01))),
        "frac_ratio_outside_0.9_1.1": float(np.mean((ratio < 0.9) | (ratio > 1.1))),
    }
print(json.dumps(res, indent=2))
