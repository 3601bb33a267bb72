#!/usr/bin/env python3
"""PyTorch peer of `update` at the issue-6 workload: a Qwen2.5-0.5B-shaped Qwen2 (HF
transformers, from config, random weights), fp32 master weights with bf16 autocast, gradient
checkpointing, fp32 log-softmax, PPO-clip loss (on-policy), fused AdamW; 640-token sequences,
micro-batches of 8, 8 micro-batches per optimizer step. Prints one JSON line: tokens/s of the
steady-state steps, MFU against a bf16 GEMM peak measured here, peak GPU memory.
`--logprob`: the forward-only peer (what ref-logprob does): the same model and micro-batches
under torch.no_grad(), fp32 log-softmax of the response positions; MFU counts 2·params.
Usage: peer_update.py [STEPS] [--logprob]"""
import json
import sys
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


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


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    logprob_only = "--logprob" in sys.argv[1:]
    steps = int(args[0]) if args else 3
    peak = gemm_peak()
    cfg = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).cuda()
    model.config.use_cache = False
    if logprob_only:
        model.eval()
    else:
        model.gradient_checkpointing_enable()
        model.train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01, fused=True)
    seq, mb, n_mb, prompt = 640, 8, 8, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    torch.cuda.reset_peak_memory_stats()

    def step():
        for _ in range(n_mb):
            ids = torch.randint(0, cfg.vocab_size, (mb, seq), device="cuda", generator=g)
            adv = torch.randn(mb, 1, device="cuda", generator=g)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=ids).logits
            lp = torch.log_softmax(logits[:, prompt - 1 : -1].float(), dim=-1)
            lp = lp.gather(-1, ids[:, prompt:, None])[..., 0]
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
            ids = torch.randint(0, cfg.vocab_size, (mb, seq), device="cuda", generator=g)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=ids).logits
            lp = torch.log_softmax(logits[:, prompt - 1 : -1].float(), dim=-1)
            out.append(lp.gather(-1, ids[:, prompt:, None])[..., 0])
        return torch.cat(out).cpu()  # one download per pass

    if logprob_only:
        step = score
    step()  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    tok_s = n_mb * mb * seq / dt
    print(json.dumps({
        "bench": "logprob" if logprob_only else "update",
        "peer": "transformers " + __import__("transformers").__version__ + ", torch " + torch.__version__,
        "params": n_params, "step_s": dt, "tokens_per_s": tok_s,
        "gemm_peak_tflops": peak / 1e12, "mfu": (2 if logprob_only else 6) * n_params * tok_s / peak,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
    }))


if __name__ == "__main__":
    main()
