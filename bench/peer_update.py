#!/usr/bin/env python3
"""PyTorch peer of `tandem bench update` / `bench logprob`, written as a PyTorch user who wants
speed would: a Qwen2.5-shaped Qwen2 (HF transformers, from config, random weights) with SDPA
attention (the flash backend: causal, no padding), the decoder under `torch.compile`, fp32 master
weights with bf16 autocast, fused AdamW, no activation checkpointing (`--checkpoint` turns it on
where memory needs it), and a chunked log-prob: the LM head and fp32 log-softmax run over 1,024
positions at a time, each chunk recomputed in the backward, so the [tokens x vocab] logits are
never all held. Loss: PPO-clip (on-policy). 640-token sequences (128 prompt), micro-batches of 8,
8 micro-batches per optimizer step: the workload of `tandem bench update`.
`--logprob`: the forward-only peer (what ref-logprob does), under torch.no_grad().
Prints one JSON line: tokens/s of the steady-state steps, MFU against a bf16 GEMM peak measured
here (6·params per token for the update, 2·params for the forward), peak GPU memory.
Usage: peer_update.py [STEPS] [--logprob] [--shape 0.5b|1.5b|7b] [--checkpoint] [--eager]"""
import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import Qwen2Config, Qwen2ForCausalLM

SHAPES = {  # layers, hidden, heads, kv heads, ffn, vocab, tied
    "0.5b": (24, 896, 14, 2, 4864, 151936, True),
    "1.5b": (28, 1536, 12, 2, 8960, 151936, True),
    "7b": (28, 3584, 28, 4, 18944, 152064, False),
}
CHUNK = 1024


def gemm_peak():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ts = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    ts.sort()
    return 2 * 8192**3 / ts[len(ts) // 2]


def chunk_logprob(h, w, targets):
    # log p(target) = logit[target] - logsumexp(logits), in fp32
    logits = F.linear(h, w).float()
    return logits.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("steps", nargs="?", type=int, default=3)
    ap.add_argument("--logprob", action="store_true")
    ap.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    ap.add_argument("--checkpoint", action="store_true")
    ap.add_argument("--eager", action="store_true")
    a = ap.parse_args()
    logprob_only, ckpt, eager, steps, shape = a.logprob, a.checkpoint, a.eager, a.steps, a.shape
    peak = gemm_peak()
    layers, hidden, heads, kv, ffn, vocab, tied = SHAPES[shape]
    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=tied,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).cuda()
    model.config.use_cache = False
    if ckpt:
        model.gradient_checkpointing_enable()
    model.train(not logprob_only)
    n_params = sum(p.numel() for p in model.parameters())
    body = model.model if eager else torch.compile(model.model)
    lp_fn = chunk_logprob if eager else torch.compile(chunk_logprob)
    head = model.lm_head.weight
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01, fused=True)
    seq, mb, n_mb, prompt = 640, 8, 8, 128
    g = torch.Generator(device="cuda").manual_seed(1)

    def logprobs(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = body(input_ids=ids).last_hidden_state[:, prompt - 1 : -1]
            h = h.reshape(-1, hidden)
            tgt = ids[:, prompt:].reshape(-1)
            w = head.to(torch.bfloat16)
            parts = []
            for i in range(0, h.shape[0], CHUNK):
                hs, ts = h[i : i + CHUNK], tgt[i : i + CHUNK]
                if torch.is_grad_enabled():
                    parts.append(checkpoint(lp_fn, hs, w, ts, use_reentrant=False))
                else:
                    parts.append(lp_fn(hs, w, ts))
        return torch.cat(parts).view(mb, seq - prompt)

    def step():
        for _ in range(n_mb):
            ids = torch.randint(0, vocab, (mb, seq), device="cuda", generator=g)
            adv = torch.randn(mb, 1, device="cuda", generator=g)
            lp = logprobs(ids)
            ratio = torch.exp(lp - lp.detach())
            loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean() / n_mb
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def score():
        out = []
        for _ in range(n_mb):
            ids = torch.randint(0, vocab, (mb, seq), device="cuda", generator=g)
            out.append(logprobs(ids))
        return torch.cat(out).cpu()  # one download per pass

    if logprob_only:
        step = score
    t_warm = time.perf_counter()
    for _ in range(2):  # warm-up: compilation, autotuning, allocator
        step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t_warm
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    tok_s = n_mb * mb * seq / dt
    print(json.dumps({
        "bench": "logprob" if logprob_only else "update", "shape": shape,
        "peer": "transformers " + __import__("transformers").__version__ + ", torch " + torch.__version__
        + (", eager" if eager else ", torch.compile") + ", sdpa" + (", checkpointing" if ckpt else ""),
        "params": n_params, "step_s": dt, "tokens_per_s": tok_s, "warmup_s": warm_s,
        "gemm_peak_tflops": peak / 1e12, "mfu": (2 if logprob_only else 6) * n_params * tok_s / peak,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
    }))


if __name__ == "__main__":
    main()
