#!/usr/bin/env python3
"""Log-probs of response tokens under HF transformers (the peer of `ref-logprob`).
Usage: hf_logprob_compare.py MODEL_DIR TOKENS_JSON OUT_JSON
Loads MODEL_DIR with transformers in bf16 (what we compare against) and in fp32 (the exact
reference), scores each prompt+response with an fp32 log-softmax, and writes both lists."""
import json
import sys

import torch
from transformers import AutoModelForCausalLM


def logprobs(model, prompts, responses):
    out = []
    for p, r in zip(prompts, responses):
        ids = torch.tensor([p + r], device="cuda")
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        # Position t predicts token t+1: the response starts at len(p).
        lp = torch.log_softmax(logits[len(p) - 1 : -1], dim=-1)
        tgt = torch.tensor(r, device="cuda")
        out.append(lp.gather(1, tgt[:, None])[:, 0].tolist())
    return out


def main():
    model_dir, tokens, out = sys.argv[1:4]
    with open(tokens) as f:
        t = json.load(f)
    res = {}
    for name, dtype in [("bf16", torch.bfloat16), ("fp32", torch.float32)]:
        m = AutoModelForCausalLM.from_pretrained(
            model_dir, torch_dtype=dtype, attn_implementation="sdpa"
        ).cuda()
        res[name] = logprobs(m, t["prompts"], t["responses"])
        del m
        torch.cuda.empty_cache()
    res["versions"] = {"torch": torch.__version__}
    try:
        import transformers

        res["versions"]["transformers"] = transformers.__version__
    except Exception:
        pass
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
