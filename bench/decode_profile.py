#!/usr/bin/env python3
"""Sums Nsight Compute's kernel times (bench/decode_profile.sh's CSV, metric
gpu__time_duration.sum) per engine step: a step ends with its sampling kernel. Prints each run of
steps with their kernel count and time, then, over the steps of the most common kernel count with
the largest batch (the decode steps), the time per kernel name per step, largest first.
Usage: decode_profile.py NCU.csv"""
import collections
import csv
import sys


def main():
    rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))
            if r.get("Metric Name") == "gpu__time_duration.sum"]
    steps, cur = [], []
    for r in rows:
        v = float(r["Metric Value"].replace(",", ""))
        cur.append((r["Kernel Name"].split("(")[0], v / 1e3, r["Grid Size"]))
        if "sample" in cur[-1][0]:
            steps.append(cur)
            cur = []
    print(f"{len(rows)} kernels timed, {len(steps)} steps (ended by a sampling kernel)")
    for i, s in enumerate(steps):
        print(f"step {i:3d}: {len(s):4d} kernels {sum(t for _, t, _ in s):9.1f} us  sample grid {s[-1][2]}")
    # The decode steps: the most common kernel count among the last 8 steps.
    tail = steps[-8:]
    n = collections.Counter(len(s) for s in tail).most_common(1)[0][0]
    dec = [s for s in tail if len(s) == n]
    per = collections.defaultdict(float)
    calls = collections.Counter()
    for s in dec:
        for name, t, _ in s:
            per[name] += t / len(dec)
            calls[name] += 1
    total = sum(per.values())
    print(f"\ndecode step ({len(dec)} steps of {n} kernels): {total:.1f} us of kernel time per step")
    for name, t in sorted(per.items(), key=lambda x: -x[1]):
        print(f"  {t:9.1f} us {100 * t / total:5.1f}%  {calls[name] // len(dec):4d} calls  {name[:90]}")


if __name__ == "__main__":
    main()
