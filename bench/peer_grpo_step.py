#!/usr/bin/env python3
"""PyTorch + HF peer of one GRPO step at the issue-8 workload, written as TRL users run it
without vLLM: a Qwen2.5-0.5B-shaped Qwen2 with random weights (fp32 master, bf16 autocast),
HF `generate` of 64 prompts x n=8 (prompts of 150 random tokens, up to 512 new tokens, each
sample stopping at a random length drawn once per step, as the random stops of our bench),
reference log-probs from a bf16 copy, old log-probs from the policy, group-normalised
advantages, then one PPO-clip update in 4 mini-batches (micro-batches of 8, gradient
checkpointing, fp32 log-softmax, fused AdamW). Prints one JSON line with seconds and peak
memory per stage. Usage: peer_grpo_step.py [PROMPTS] [N] [MAX_NEW]"""
import json
import sys
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, StoppingCriteria, StoppingCriteriaList


class StopAtLength(StoppingCriteria):
    """Row i is done once it has `lengths[i]` new tokens (transformers checks per row)."""

    def __init__(self, prompt_len, lengths):
        self.prompt_len = prompt_len
        self.lengths = lengths

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids.shape[1] - self.prompt_len) >= self.lengths


def stage(name, times, mems, fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    times[name] = time.perf_counter() - t0
    mems[name] = torch.cuda.max_memory_allocated() / 2**30
    return out


def seq_logprobs(model, ids, prompt_len, mb, grad=False):
    out = []
    for i in range(0, ids.shape[0], mb):
        x = ids[i : i + mb]
        with torch.autocast("cuda", dtype=torch.bfloat16), torch.set_grad_enabled(grad):
            logits = model(input_ids=x).logits
        lp = torch.log_softmax(logits[:, prompt_len - 1 : -1].float(), dim=-1)
        out.append(lp.gather(-1, x[:, prompt_len:, None])[..., 0])
    return torch.cat(out)


def main():
    prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    max_new = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    prompt_len, mb, minibatches = 150, 8, 4
    cfg = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    policy = Qwen2ForCausalLM(cfg).cuda()
    ref = Qwen2ForCausalLM(cfg).to(dtype=torch.bfloat16).cuda()
    ref.load_state_dict(policy.state_dict())
    ref.eval()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6, weight_decay=0.01, fused=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (prompts, prompt_len), device="cuda", generator=g)
    lengths = torch.randint(1, max_new + 1, (prompts * n,), device="cuda", generator=g)
    times, mems = {}, {}

    def rollout():
        policy.eval()
        policy.config.use_cache = True
        with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
            return policy.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=n,
                max_new_tokens=max_new, min_new_tokens=0, pad_token_id=0, eos_token_id=None,
                stopping_criteria=StoppingCriteriaList([StopAtLength(prompt_len, lengths)]),
            )

    seqs = stage("rollout", times, mems, rollout)
    new = seqs.shape[1] - prompt_len
    mask = (torch.arange(new, device="cuda")[None, :] < lengths[:, None]).float()
    gen_tokens = int(mask.sum().item())
    ref_lp = stage("ref_logprob", times, mems, lambda: seq_logprobs(ref, seqs, prompt_len, mb))
    old_lp = stage("old_logprob", times, mems, lambda: seq_logprobs(policy, seqs, prompt_len, mb))
    reward = torch.randn(prompts, n, device="cuda", generator=g)
    adv = ((reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6)).reshape(-1)

    def update():
        policy.train()
        policy.config.use_cache = False
        policy.gradient_checkpointing_enable()
        rows = seqs.shape[0]
        per_mini = rows // minibatches
        for m in range(minibatches):
            for i in range(m * per_mini, (m + 1) * per_mini, mb):
                sl = slice(i, i + mb)
                lp = seq_logprobs(policy, seqs[sl], prompt_len, mb, grad=True)
                ratio = torch.exp(lp - old_lp[sl])
                a = adv[sl, None]
                per_tok = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a)
                kl = torch.exp(ref_lp[sl] - lp) - (ref_lp[sl] - lp) - 1  # k3
                loss = ((per_tok + 0.001 * kl) * mask[sl]).sum() / mask[m * per_mini : (m + 1) * per_mini].sum()
                loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    stage("update", times, mems, update)
    total = sum(times.values())
    print(json.dumps({
        "peer": "transformers " + __import__("transformers").__version__ + ", torch " + torch.__version__,
        "prompts": prompts, "n": n, "max_new_tokens": max_new, "generated_tokens": gen_tokens,
        "step_s": total, "stage_s": times, "stage_peak_gib": mems,
        "rollout_tokens_per_s": gen_tokens / times["rollout"],
    }))


if __name__ == "__main__":
    main()
