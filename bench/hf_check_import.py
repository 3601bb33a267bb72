#!/usr/bin/env python3
"""Dev-machine check of an imported GGUF model against HF transformers (CPU, f32).

  hf_check_import.py MODEL_DIR BATCH.parquet [--tol 1e-3] [--json OUT]

BATCH is the output of tandem's `ref-logprob --column ref_logprobs` on a rollout of MODEL_DIR (it has
prompt, prompt_ids, response_ids and ref_logprobs). This script
  1. loads MODEL_DIR with transformers (AutoModelForCausalLM, float32) and AutoTokenizer;
  2. checks that transformers' chat template + tokenizer give the same prompt ids as ours;
  3. computes f32 log-probs of every response token and compares them with ref_logprobs;
  4. with --gguf FILE: loads FILE with transformers' own GGUF loader (gguf package's dequantize,
     its own name map and llama Q/K un-permutation; needs `pip install gguf accelerate`) and
     checks that every tensor of our model.safetensors equals it rounded to bf16, and that
     transformers' own tokenizer rebuilt from FILE gives our ids on the strings of
     tests/fixtures/gguf/qwen_tokenizer_ids.json.
Exit 1 when the largest difference is over --tol. Not part of the Rust build or `make test`.
"""
import argparse
import json
import sys
import time

import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def compare_with_transformers_gguf(model_dir, gguf_path):
    import os
    from safetensors.torch import load_file
    ref = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path),
        dtype=torch.float32).state_dict()
    ours = load_file(os.path.join(model_dir, "model.safetensors"))
    bad = [k for k, v in ours.items() if not torch.equal(ref[k].to(v.dtype), v)]
    ref_tok = AutoTokenizer.from_pretrained(
        os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path))
    our_tok = AutoTokenizer.from_pretrained(model_dir)
    fixture = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "gguf",
                           "qwen_tokenizer_ids.json")
    texts = [c["text"] for c in json.load(open(fixture))]
    tok_bad = [t for t in texts if our_tok(t, add_special_tokens=False)["input_ids"]
               != ref_tok(t, add_special_tokens=False)["input_ids"]]
    return {"tensors": len(ours), "mismatched_tensors": len(bad), "mismatched": bad[:10],
            "only_in_transformers": sorted(set(ref) - set(ours)),
            "tokenizer_strings": len(texts), "tokenizer_mismatches": len(tok_bad)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("batch")
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--json")
    ap.add_argument("--gguf", help="the GGUF file MODEL_DIR was imported from")
    a = ap.parse_args()
    torch.set_num_threads(2)
    t = pq.read_table(a.batch).to_pylist()
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    model.eval()

    prompt_mismatch = 0
    max_diff, n_tokens, sum_diff = 0.0, 0, 0.0
    t0 = time.time()
    for row in t:
        messages = row["prompt"]
        hf_prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        hf_ids = tok(hf_prompt, add_special_tokens=False)["input_ids"]
        if hf_ids != row["prompt_ids"]:
            prompt_mismatch += 1
        p, r = row["prompt_ids"], row["response_ids"]
        ids = torch.tensor([p + r])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        # Position t predicts token t+1: the response starts at len(p).
        lp = torch.log_softmax(logits[len(p) - 1:-1], dim=-1)
        ours = torch.tensor(row["ref_logprobs"], dtype=torch.float32)
        hf = lp.gather(1, torch.tensor(r)[:, None])[:, 0]
        d = (hf - ours).abs()
        max_diff = max(max_diff, d.max().item())
        sum_diff += d.sum().item()
        n_tokens += len(r)
    res = {
        "model_dir": a.model_dir,
        "rows": len(t),
        "response_tokens": n_tokens,
        "prompt_id_mismatches": prompt_mismatch,
        "max_abs_logprob_diff": max_diff,
        "mean_abs_logprob_diff": sum_diff / max(n_tokens, 1),
        "seconds": round(time.time() - t0, 1),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }
    print(json.dumps(res, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    ok = max_diff <= a.tol and prompt_mismatch == 0
    if a.gguf:
        res["gguf"] = compare_with_transformers_gguf(a.model_dir, a.gguf)
        print(json.dumps(res["gguf"], indent=2))
        ok = ok and res["gguf"]["mismatched_tensors"] == 0 and res["gguf"]["tokenizer_mismatches"] == 0
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=2)
    print("OK" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
