#!/usr/bin/env python3
"""The PyTorch NCCL peer of `tandem bench dist`: all-reduce, all-gather and reduce-scatter
bus bandwidth through torch.distributed, measured the way `tandem bench dist` measures (see
src/lib/dist/bench.rs): each timed run is one collective between two device syncs, the median
over the runs, the slowest rank's; S is the whole buffer (all-gather: the gathered result,
reduce-scatter: the input); busbw = S/t * 2(n-1)/n (all-reduce) or S/t * (n-1)/n.

  python3 -m torch.distributed.run --standalone --nproc-per-node N bench/peer_nccl.py \
      [--sizes 64MiB,1GiB] [--iters 20] [--warmup 5] [--json out.json]
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def parse_size(s):
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if s.endswith(u):
            return int(s[: -len(u)]) * m
    return int(s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64MiB,256MiB,1GiB")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    n, r = dist.get_world_size(), dist.get_rank()
    rows = []
    for size in [parse_size(s) for s in a.sizes.split(",")]:
        elems = size // 2  # bf16
        chunk = elems // n
        whole = torch.full((chunk * n,), float(r + 1), dtype=torch.bfloat16, device="cuda")
        part = torch.full((chunk,), float(r + 1), dtype=torch.bfloat16, device="cuda")
        ops = {
            "all_reduce": (lambda: dist.all_reduce(whole), 2 * (n - 1) / n),
            "all_gather": (lambda: dist.all_gather_into_tensor(whole, part), (n - 1) / n),
            "reduce_scatter": (lambda: dist.reduce_scatter_tensor(part, whole), (n - 1) / n),
        }
        for name, (op, factor) in ops.items():
            times = []
            for i in range(a.warmup + a.iters):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                op()
                torch.cuda.synchronize()
                if i >= a.warmup:
                    times.append(time.perf_counter() - t0)
            t = torch.tensor([statistics.median(times)], device="cuda", dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            t = t.item()
            s = chunk * n * 2
            algbw = s / t / 1e9
            rows.append(
                {"op": name, "world": n, "bytes": s, "ms": t * 1e3, "algbw_gbs": algbw,
                 "busbw_gbs": algbw * factor}
            )
    if r == 0:
        print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, {n} rank(s)")
        print(f"{'op':<16}{'size':>12}{'ms':>10}{'algbw GB/s':>12}{'busbw GB/s':>12}")
        for x in rows:
            print(f"{x['op']:<16}{x['bytes']:>12}{x['ms']:>10.3f}{x['algbw_gbs']:>12.2f}{x['busbw_gbs']:>12.2f}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
