#!/usr/bin/env python3
"""vLLM peer of `tandem bench rollout`, on the same work: the model shape (the HF config.json in
the bench's `--cases-out` file; vLLM fills its own random weights, `load_format="dummy"`), or,
when the bench ran a model directory (`--model DIR`, the file's `model_dir`), that directory's
weights; and per case the same prompt ids, samples per prompt and new tokens, temperature 1,
ending at the case's stop ids (the model's EOS ids of `--prompts` cases) or, without any, with
`ignore_eos`. Cases with random stops (a random model's stand-in ends) are skipped.
Each case: one untimed warm-up generate, then RUNS timed ones; prints one JSON line per case
(best and all tokens/s, and the length distribution of the best run: mean, nearest-rank p50,
p90, p99, max and the share at the cap, as the bench computes it; with nvidia-smi, the best
run's SM clock, power and tokens per joule, sampled every 100 ms as `bench rollout` samples
its own) and one for the start-up.
Tuning (what a fair comparison sets, ../shared/peers/vllm/README.md): `max_num_seqs` covers the
largest case, CUDA graphs are captured up to it (`max_cudagraph_capture_size`), async scheduling
and prefix caching stay on (the defaults); MAX_BATCHED_TOKENS [16384] sets
`max_num_batched_tokens`; GPU_UTIL [0.85] the memory fraction. The engine has seed 0; requests
have no seed of their own unless REQUEST_SEED is set (until 2026-11-28 evening every request had
seed 0, which makes vLLM's sampler draw row by row).
Usage: peer_vllm.py CASES.json [RUNS]   (needs vllm on PYTHONPATH: install_on_device.sh)
       peer_vllm.py --check CASES.json     (no vllm: the cases as this script reads them)"""
import json
import os
import subprocess
import sys
import tempfile
import threading
import time


class Clocks:
    """`nvidia-smi` sampling the GPU's SM clock, power and power-cap bit every 100 ms (as
    src/lib/bench/gpu_clock.rs does for tandem); nothing without nvidia-smi."""

    def __init__(self):
        gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
        self.samples = []
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
                 "--format=csv,noheader,nounits", "-lms", "100", "-i", gpu],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                mhz, watts, reasons = [f.strip() for f in line.split(",")]
                self.samples.append((time.perf_counter(), float(mhz), float(watts),
                                     int(reasons, 16) & 0x4 != 0))
            except ValueError:
                continue

    def summary(self, t0, t1, tokens_per_s):
        """The samples between t0 and t1 as the bench's `gpu_clocks`, and tokens per joule."""
        w = [s for s in self.samples if t0 <= s[0] <= t1]
        if not w:
            return None
        mhz = sorted(s[1] for s in w)
        power = sum(s[2] for s in w) / len(w)
        return {"samples": len(w), "sm_mhz_median": mhz[len(mhz) // 2], "power_w_mean": power,
                "power_w_max": max(s[2] for s in w),
                "power_capped_fraction": sum(s[3] for s in w) / len(w),
                "tokens_per_joule": tokens_per_s / power if power > 0 else None}

    def close(self):
        if self.proc:
            self.proc.kill()


def lengths(lens, cap):
    """The bench's `Lengths`: mean, the ceil(q*n)-th smallest for q = 50, 90, 99 percent, the
    longest, and the share of samples at the cap."""
    s = sorted(lens)
    n = len(s)
    rank = lambda q: s[max(-(-q * n // 100), 1) - 1] if n else 0
    return {"mean": sum(s) / max(n, 1), "p50": rank(50), "p90": rank(90), "p99": rank(99),
            "max": s[-1] if n else 0, "at_cap_fraction": sum(l >= cap for l in s) / max(n, 1)}


def model_args(doc):
    """The model vLLM loads: the bench's model directory with its weights, or a directory
    holding the shape's config.json for vLLM's own random weights."""
    if doc.get("model_dir"):
        return {"model": doc["model_dir"]}
    model_dir = tempfile.mkdtemp(prefix="peer_vllm_")
    cfg = dict(doc["config"])
    cfg.setdefault("architectures", ["Qwen2ForCausalLM"])
    cfg.setdefault("model_type", "qwen2")
    cfg["torch_dtype"] = "bfloat16"
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return {"model": model_dir, "load_format": "dummy"}


def engine_args(doc):
    """`LLM(...)`'s arguments: seats and CUDA graphs for the largest case (`max_num_seqs`,
    `max_cudagraph_capture_size`), room for the longest prompt and its new tokens."""
    cases = doc["cases"]
    max_seqs = max(len(c["prompts"]) * c["n"] for c in cases)
    max_len = max(max(len(p) for p in c["prompts"]) + c["max_new_tokens"] for c in cases)
    return dict(
        **model_args(doc), dtype="bfloat16", skip_tokenizer_init=True, seed=0,
        gpu_memory_utilization=float(os.environ.get("GPU_UTIL", "0.85")),
        max_num_seqs=max_seqs, max_model_len=max_len,
        max_num_batched_tokens=int(os.environ.get("MAX_BATCHED_TOKENS", "16384")),
        max_cudagraph_capture_size=max_seqs,
    )


def request_seed():
    """REQUEST_SEED: a seed per request (vLLM then draws each seeded row with its own generator,
    one call per row and step: its sampler's own note says this is slow); unset, the engine's
    seed alone, as RL frameworks call vLLM."""
    seed = os.environ.get("REQUEST_SEED", "")
    return int(seed) if seed else None


def sampling_args(c):
    """`SamplingParams(...)`'s arguments for a case: temperature 1, its cap, its stop ids (an
    ending stop id stays in the sample's token_ids, as in tandem's response), or none at all
    (`ignore_eos`)."""
    stops = c["stop_token_ids"]
    return dict(n=c["n"], temperature=1.0, max_tokens=c["max_new_tokens"], ignore_eos=not stops,
                stop_token_ids=stops or None, detokenize=False, seed=request_seed())


def check(doc):
    """Without vllm: what each case would run, one JSON line each (a dry run on any machine)."""
    args = engine_args(doc)
    print(json.dumps({"llm": args}))
    clocks = Clocks()
    for c in doc["cases"]:
        if c["random_stops"]:
            print(json.dumps({"case": c["case"], "skipped": "random stops"}))
            continue
        print(json.dumps({"case": c["case"], "prompts": len(c["prompts"]),
                          "prompt_tokens": sum(map(len, c["prompts"])),
                          "sampling": sampling_args(c)}))


def main():
    if sys.argv[1] == "--check":
        return check(json.load(open(sys.argv[2])))
    doc = json.load(open(sys.argv[1]))
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 2

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import vllm

    t0 = time.perf_counter()
    args = engine_args(doc)
    llm = LLM(**args)
    print(json.dumps({"peer": "vllm " + vllm.__version__, "model": doc["model"],
                      "init_s": time.perf_counter() - t0,
                      "max_num_seqs": args["max_num_seqs"]}), flush=True)
    for c in doc["cases"]:
        if c["random_stops"]:
            print(json.dumps({"peer": "vllm", "case": c["case"], "skipped": "random stops"}))
            continue
        prompts = [TokensPrompt(prompt_token_ids=p) for p in c["prompts"]]
        sp = SamplingParams(**sampling_args(c))
        llm.generate(prompts, sp, use_tqdm=False)  # warm-up
        best, rates, gpu = None, [], None
        for _ in range(runs):
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            t1 = time.perf_counter()
            lens = [len(o2.token_ids) for o in outs for o2 in o.outputs]
            rates.append(sum(lens) / (t1 - t))
            if rates[-1] == max(rates):
                best, gpu = lens, clocks.summary(t, t1, rates[-1])
        print(json.dumps({"peer": "vllm", "model": doc["model"], "case": c["case"],
                          "samples": len(best), "new_tokens": sum(best),
                          "tokens_per_s": max(rates), "runs_tokens_per_s": rates,
                          "request_seed": sp.seed, "lengths": lengths(best, c["max_new_tokens"]),
                          "gpu_clocks": gpu}), flush=True)
    clocks.close()


if __name__ == "__main__":
    main()
