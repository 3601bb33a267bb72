#!/usr/bin/env python3
"""Where does bf16 log-prob error come from? Scores the same sequences as
hf_logprob_compare.py under several transformers precision set-ups, so the log-probs of
`ref-logprob --device cuda` can be compared with each (bench/compare_precision.py, here):
  fp32            fp32 weights and math (the reference)
  bf16            bf16 weights, bf16 logits upcast for an fp32 log-softmax (what users run)
  bf16_fp32head   bf16 body; the LM head in fp32 from the bf16 final hidden state and the
                  bf16 weights (no bf16 rounding of the logits: our LM head's rounding points)
  fp32_bf16hidden fp32 body, final hidden state rounded to bf16, head in fp32 from bf16-rounded
                  weights (only the head's inputs rounded)
  autocast        fp32 weights under torch.autocast(bf16) (the peer's training forward)
Usage: hf_precision.py MODEL_DIR TOKENS_JSON OUT_JSON"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM


def score(prompts, responses, logits_of):
    out = []
    for p, r in zip(prompts, responses):
        ids = torch.tensor([p + r], device="cuda")
        with torch.no_grad():
            logits = logits_of(ids)[0].float()
        lp = torch.log_softmax(logits[len(p) - 1 : -1], dim=-1)
        tgt = torch.tensor(r, device="cuda")
        out.append(lp.gather(1, tgt[:, None])[:, 0].tolist())
    return out


def load(model_dir, dtype):
    return AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=dtype, attn_implementation="sdpa"
    ).cuda().eval()


def main():
    model_dir, tokens, out = sys.argv[1:4]
    with open(tokens) as f:
        t = json.load(f)
    P, R = t["prompts"], t["responses"]
    res = {}

    m = load(model_dir, torch.float32)
    res["fp32"] = score(P, R, lambda ids: m(ids).logits)
    w_bf = m.lm_head.weight.detach().to(torch.bfloat16).float()

    def fp32_bf16hidden(ids):
        h = m.model(ids).last_hidden_state
        return h.to(torch.bfloat16).float() @ w_bf.T

    res["fp32_bf16hidden"] = score(P, R, fp32_bf16hidden)

    def autocast(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return m(ids).logits

    res["autocast"] = score(P, R, autocast)
    del m
    torch.cuda.empty_cache()

    m = load(model_dir, torch.bfloat16)
    res["bf16"] = score(P, R, lambda ids: m(ids).logits)
    wb = m.lm_head.weight.detach().float()

    def bf16_fp32head(ids):
        h = m.model(ids).last_hidden_state
        return h.float() @ wb.T

    res["bf16_fp32head"] = score(P, R, bf16_fp32head)
    import transformers

    res["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
