#!/bin/bash
# On the GPU machine: is a GRPO step bit-reproducible? The same `bench grpo-step` twice (in-process
# and daemon modes each), files compared; then the optimizer tensors that differ.
D=${D:-.device/lead}; export TANDEM_CACHE=/root/tandem-cache
$D/tandem init-model --like qwen2 --layers 24 --hidden 896 --heads 14 --kv-heads 2 --ffn 4864 \
    --vocab 151936 --tie true --rope-theta 1000000 --rms-norm-eps 1e-6 --seed 1 --out /tmp/q05g > /dev/null
for w in a b; do
  $D/tandem bench grpo-step --device cuda --model /tmp/q05g --prompts $D/prompts200.parquet --raw-prompt \
    --work /tmp/g$w --prompts-per-step 32 --n 8 --max-new-tokens 128 --mini-batches 4 --steps 2 > $OUT/g$w.txt 2>&1; echo "run $w rc=$?"
done
cmpdir() { for f in $(cd $1 && find . -type f | sort); do cmp -s "$1/$f" "$2/$f" && echo "same $f" || echo "DIFF $f"; done; }
echo "== in-process run a vs run b"; cmpdir /tmp/ga/in-process /tmp/gb/in-process
echo "== daemon run a vs run b"; cmpdir /tmp/ga/daemon /tmp/gb/daemon
echo "== in-process a vs daemon a"; cmpdir /tmp/ga/in-process /tmp/ga/daemon
python3 - <<'PY2'
import glob, os
import pyarrow.parquet as pq
for a_dir, b_dir in [("/tmp/ga/in-process", "/tmp/gb/in-process"), ("/tmp/ga/in-process", "/tmp/ga/daemon")]:
    for f in sorted(glob.glob(a_dir + "/*.parquet")):
        g = os.path.join(b_dir, os.path.basename(f))
        ta, tb = pq.read_table(f), pq.read_table(g)
        ma, mb = ta.schema.metadata or {}, tb.schema.metadata or {}
        keys = sorted(k.decode() for k in set(ma) | set(mb) if ma.get(k) != mb.get(k))
        print(f"{a_dir} vs {b_dir} {os.path.basename(f)}: data {'same' if ta.equals(tb) else 'DIFFERENT'}; metadata keys that differ: {keys}")
PY2
python3 - <<'PY'
import torch
from safetensors.torch import load_file
a=load_file('/tmp/ga/in-process/ckpt-1/optimizer.safetensors'); b=load_file('/tmp/ga/daemon/ckpt-1/optimizer.safetensors')
ks=sorted(set(a)|set(b)); print("keys only in one:", sorted(set(a)^set(b))[:5])
d=[(k,(a[k].float()-b[k].float()).abs().max().item()) for k in ks if k in a and k in b]
d=[x for x in d if x[1]>0]; print(len(d),"tensors differ; worst:", sorted(d,key=lambda x:-x[1])[:4])
PY
