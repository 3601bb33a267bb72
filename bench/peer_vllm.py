#!/usr/bin/env python3
"""vLLM peer of `tandem bench rollout`, on the same work: the model shape (the HF config.json in
the bench's `--cases-out` file; vLLM fills its own random weights, `load_format="dummy"`) and, per
case, the same prompt ids, samples per prompt and new tokens, with `ignore_eos`, temperature 1.
Each case: one untimed warm-up generate, then RUNS timed ones; prints one JSON line per case
(best and all tokens/s) and one for the engine's start-up.
Tuning (what a fair comparison sets, ../shared/peers/vllm/README.md): `max_num_seqs` covers the
largest case, CUDA graphs are captured up to it (`max_cudagraph_capture_size`), async scheduling
and prefix caching stay on (the defaults); MAX_BATCHED_TOKENS [16384] sets
`max_num_batched_tokens`; GPU_UTIL [0.85] the memory fraction.
Usage: peer_vllm.py CASES.json [RUNS]   (needs vllm on PYTHONPATH: install_on_device.sh)"""
import json
import os
import sys
import tempfile
import time


def main():
    doc = json.load(open(sys.argv[1]))
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    model_dir = tempfile.mkdtemp(prefix="peer_vllm_")
    cfg = dict(doc["config"])
    cfg.setdefault("architectures", ["Qwen2ForCausalLM"])
    cfg.setdefault("model_type", "qwen2")
    cfg["torch_dtype"] = "bfloat16"
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    cases = doc["cases"]
    max_seqs = max(len(c["prompts"]) * c["n"] for c in cases)
    max_len = max(max(len(p) for p in c["prompts"]) + c["max_new_tokens"] for c in cases)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import vllm

    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir, dtype="bfloat16", skip_tokenizer_init=True, load_format="dummy", seed=0,
        gpu_memory_utilization=float(os.environ.get("GPU_UTIL", "0.85")),
        max_num_seqs=max_seqs, max_model_len=max_len,
        max_num_batched_tokens=int(os.environ.get("MAX_BATCHED_TOKENS", "16384")),
        max_cudagraph_capture_size=max_seqs,
    )
    print(json.dumps({"peer": "vllm " + vllm.__version__, "model": doc["model"],
                      "init_s": time.perf_counter() - t0, "max_num_seqs": max_seqs}), flush=True)
    for c in cases:
        if c["stops"]:
            print(json.dumps({"peer": "vllm", "case": c["case"], "skipped": "random stops"}))
            continue
        prompts = [TokensPrompt(prompt_token_ids=p) for p in c["prompts"]]
        sp = SamplingParams(n=c["n"], temperature=1.0, max_tokens=c["max_new_tokens"],
                            ignore_eos=True, detokenize=False, seed=0)
        llm.generate(prompts, sp, use_tqdm=False)  # warm-up
        rates = []
        for _ in range(runs):
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t
            toks = sum(len(o2.token_ids) for o in outs for o2 in o.outputs)
            rates.append(toks / dt)
        print(json.dumps({"peer": "vllm", "model": doc["model"], "case": c["case"],
                          "new_tokens": toks, "tokens_per_s": max(rates),
                          "runs_tokens_per_s": rates}), flush=True)


if __name__ == "__main__":
    main()
