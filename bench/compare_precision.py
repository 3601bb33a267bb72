#!/usr/bin/env python3
"""Compares `ref-logprob --device cuda` log-probs (q05_ours.parquet) with the transformers
set-ups of hf_precision.py (q05_hf.json): mean and max |Δ| of every pair that matters.
Usage: compare_precision.py RESULTS_DIR"""
import json
import sys

import numpy as np
import pyarrow.parquet as pq


def main():
    d = sys.argv[1]
    ours = np.concatenate(
        [np.asarray(r, dtype=np.float64) for r in pq.read_table(f"{d}/q05_ours.parquet")["ref_logprobs"].to_pylist()]
    )
    hf = json.load(open(f"{d}/q05_hf.json"))
    runs = {k: np.concatenate([np.asarray(r, dtype=np.float64) for r in v]) for k, v in hf.items() if k != "versions"}
    runs = {"ours": ours, **runs}
    print(f"{len(ours)} scored tokens; {hf.get('versions')}")
    names = list(runs)
    print(f"{'a':16} {'b':16} {'mean |Δ|':>10} {'max |Δ|':>10}")
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            x = np.abs(runs[a] - runs[b])
            print(f"{a:16} {b:16} {x.mean():10.2e} {x.max():10.2e}")


if __name__ == "__main__":
    main()
