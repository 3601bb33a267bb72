#!/usr/bin/env python3
"""The HF `generate` peer of `tandem bench rollout` (issue 7): the Qwen2.5-0.5B shape with
random weights, bf16, sdpa attention, on the GPU; forced lengths (min_new_tokens =
max_new_tokens, no EOS), sampling at T = 1. Prints a table line per batch and one JSON line.
Usage: peer_generate.py [--batches 64,256] [--prompt 128] [--new 256]"""
import argparse
import json
import time

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("--batches", default="64,256")
ap.add_argument("--prompt", type=int, default=128)
ap.add_argument("--new", type=int, default=256)
a = ap.parse_args()

cfg = Qwen2Config(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
    tie_word_embeddings=True, max_position_embeddings=32768, attn_implementation="sdpa",
)
torch.manual_seed(0)
with torch.device("cuda"):
    torch.set_default_dtype(torch.bfloat16)
    model = Qwen2ForCausalLM(cfg).eval()
gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                      max_new_tokens=a.new, min_new_tokens=a.new, eos_token_id=None,
                      pad_token_id=0)
rows = []
with torch.inference_mode():
    ids = torch.randint(0, cfg.vocab_size, (4, 16), device="cuda")
    model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=GenerationConfig(
        do_sample=True, max_new_tokens=4, min_new_tokens=4, eos_token_id=None, pad_token_id=0))
    for b in [int(x) for x in a.batches.split(",")]:
        ids = torch.randint(0, cfg.vocab_size, (b, a.prompt), device="cuda")
        torch.cuda.synchronize()
        t = time.time()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
        torch.cuda.synchronize()
        s = time.time() - t
        new = (out.shape[1] - a.prompt) * b
        rows.append({"batch": b, "prompt": a.prompt, "new_tokens": new, "seconds": s,
                     "tokens_per_s": new / s})
        print(f"HF generate batch {b} x prompt {a.prompt} x {a.new} new: {new} tokens in {s:.2f} s = {new / s:.0f} tok/s", flush=True)
print(json.dumps({"peer": "hf_generate", "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}))
