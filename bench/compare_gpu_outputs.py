#!/usr/bin/env python3
"""Compares what bench/gpu_stages.sh wrote: `update` and `ref-logprob` on --device cuda vs
--device cpu (tiny model), and our bf16 log-probs of the Qwen2.5-0.5B-shaped model vs
transformers. Usage: compare_gpu_outputs.py OUT_DIR INITIAL_TINY_MODEL_DIR"""
import json
import struct
import sys

import numpy as np
import pyarrow.parquet as pq


def safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, h in head.items():
        if name == "__metadata__":
            continue
        a, b = h["data_offsets"]
        raw = data[a:b]
        if h["dtype"] == "F32":
            v = np.frombuffer(raw, dtype=np.float32)
        elif h["dtype"] == "BF16":
            v = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError(h["dtype"])
        out[name] = v.reshape(h["shape"])
    return out


def flat_lists(path, col):
    return np.concatenate([np.asarray(r, dtype=np.float64) for r in pq.read_table(path)[col].to_pylist()])


def main():
    out, init = sys.argv[1], sys.argv[2]
    import glob

    w0 = {}
    for f in glob.glob(f"{init}/*.safetensors"):
        w0.update(safetensors(f))
    oc = safetensors(f"{out}/upd_cpu/optimizer.safetensors")
    og = safetensors(f"{out}/upd_cuda/optimizer.safetensors")
    # Adam turns tiny gradients into ±lr steps, so bf16 noise can flip single elements: report
    # the relative L2 error of the whole update and the share of flipped signs.
    num = den = 0.0
    flips = total = 0
    for k in oc:
        if not k.startswith("master."):
            continue
        base = w0[k[len("master."):]].astype(np.float64)
        dc, dg = oc[k] - base, og[k] - base
        num += float(((dg - dc) ** 2).sum())
        den += float((dc**2).sum())
        flips += int((np.sign(dg) != np.sign(dc)).sum())
        total += dc.size
    print(
        f"update cuda vs cpu: master-weight update rel L2 err {np.sqrt(num / den):.3e}, "
        f"sign flips {flips}/{total}"
    )
    mc = json.load(open(f"{out}/upd_cpu.json"))
    mg = json.load(open(f"{out}/upd_cuda.json"))
    for k in ["pg_loss", "grad_norm", "entropy"]:
        if k in mc:
            print(f"  {k}: cpu {mc[k]:.6g} cuda {mg[k]:.6g}")
    for col in ["ref_logprobs", "entropy"]:
        try:
            c, g = flat_lists(f"{out}/ref_cpu.parquet", col), flat_lists(f"{out}/ref_cuda.parquet", col)
        except KeyError:
            continue
        d = np.abs(g - c)
        print(f"ref-logprob cuda vs cpu, {col}: max |d| {d.max():.3e} mean |d| {d.mean():.3e} ({len(d)} tokens)")
    ours = flat_lists(f"{out}/q05_ours.parquet", "ref_logprobs")
    hf = json.load(open(f"{out}/q05_hf.json"))
    for name in ["bf16", "fp32"]:
        ref = np.concatenate([np.asarray(r, dtype=np.float64) for r in hf[name]])
        d = np.abs(ours - ref)
        print(f"q05 ours(bf16) vs transformers {name}: max |d| {d.max():.3e} mean |d| {d.mean():.3e} ({len(d)} tokens)")
    a = np.concatenate([np.asarray(r) for r in hf["bf16"]])
    b = np.concatenate([np.asarray(r) for r in hf["fp32"]])
    d = np.abs(a - b)
    print(f"q05 transformers bf16 vs fp32: max |d| {d.max():.3e} mean |d| {d.mean():.3e}")
    print("versions:", hf.get("versions"))


if __name__ == "__main__":
    main()
