#!/usr/bin/env python3
"""The rollout rows of a bench/vllm_lease.sh plan, one line per case: tandem's tokens/s (the
last run of `bench rollout`'s JSON), vLLM's (best of its runs, bench/peer_vllm.py), the ratio,
both engines' length distributions (mean/p50/p90/p99/max, share at the cap), and vLLM with a
seed per request where the plan ran it (SEEDED_TOO=1).
Usage: vllm_summary.py DIR   (the plan's G: rollout_X.txt, vllm_X.txt)"""
import glob
import json
import os
import sys


def last_json(path):
    """The last line of a file that is a JSON object, or None."""
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def peer_lines(path):
    """bench/peer_vllm.py's JSON lines by case."""
    out = {}
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if "case" in d:
            out[d["case"]] = d
    return out


def lens(d):
    l = d.get("lengths") if d else None
    if not l:
        return "-"
    return "%.0f/%d/%d/%d/%d %.1f%%" % (l["mean"], l["p50"], l["p90"], l["p99"], l["max"],
                                        100 * l["at_cap_fraction"])


def energy(clocks, tokens_per_joule=None):
    """SM MHz / W and tokens per joule of a run's `gpu_clocks` ("-" without nvidia-smi)."""
    if not clocks:
        return "-"
    tpj = tokens_per_joule or clocks.get("tokens_per_joule")
    return "%.0f / %.0f, %s" % (clocks["sm_mhz_median"], clocks["power_w_mean"],
                               "%.1f" % tpj if tpj else "-")


def main():
    g = sys.argv[1]
    print("| shape | case | tandem tok/s | vLLM tok/s | tandem / vLLM | tandem lengths | vLLM lengths "
          "| vLLM, seeded requests | tandem SM MHz / W, tok/J | vLLM SM MHz / W, tok/J |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in sorted(glob.glob(os.path.join(g, "rollout_*.txt"))):
        shape = os.path.basename(path)[len("rollout_"):-len(".txt")]
        rep = last_json(path)
        if not rep:
            print("| %s | (no report: see %s) | | | | | | | | |" % (shape, os.path.basename(path)))
            continue
        # The last run of each case (the runs after a process's first are what later rollouts cost).
        runs = {}
        for c in rep.get("cases", []):
            runs[c["case"]] = c
        peer = peer_lines(os.path.join(g, "vllm_%s.txt" % shape))
        seeded = peer_lines(os.path.join(g, "vllm_%s_seeded.txt" % shape))
        for name, t in runs.items():
            v = peer.get(name, {})
            vt = v.get("tokens_per_s")
            ratio = "%.2fx" % (t["tokens_per_s"] / vt) if vt else "-"
            vcell = "%.0f" % vt if vt else v.get("skipped", "check" if "sampling" in v else "-")
            st = seeded.get(name, {}).get("tokens_per_s")
            print("| %s | %s | %.0f | %s | %s | %s | %s | %s | %s | %s |" % (
                shape, name, t["tokens_per_s"], vcell, ratio, lens(t), lens(v),
                "%.0f" % st if st else "-", energy(t.get("gpu_clocks"), t.get("tokens_per_joule")),
                energy(v.get("gpu_clocks"))))


if __name__ == "__main__":
    main()
