#!/bin/bash
# GPU check A: new kernels' exactness, GDN/attention packed timing, batching on the 27B shape, join latency
export PYTHONPATH=$PWD
python -m pip install -q --no-index --find-links .whl fastapi uvicorn pydantic llguidance 2>&1 | grep -v WARNING | tail -2
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
echo "== attn_multi"; timeout 120 python -m bench.attn_multi > $OUT/attn_multi.txt 2>&1; echo rc=$?; tail -12 $OUT/attn_multi.txt | cut -c1-300
echo "== gdn_packed"; timeout 120 python -m bench.gdn_packed --shape 27B --rows 1,1,1,1,1,1,1,1 --rows 4,4,4,4,4,4,4,4 --rows 1,4,3,4 > $OUT/gdn_packed.txt 2>&1; echo rc=$?; tail -8 $OUT/gdn_packed.txt | cut -c1-300
echo "== exact"; timeout 200 python -m bench.batch --exact-only > $OUT/exact.txt 2>&1; echo rc=$?; grep '"stage": "exact"' $OUT/exact.txt | cut -c1-400; tail -1 $OUT/exact.txt | cut -c1-200
echo "== ckpt"; timeout 200 python -c "
import torch
from bench.common import model_config, write_checkpoint, write_tokenizer
cfg = model_config('27B'); p = write_checkpoint('/dev/shm/m27', cfg, torch.bfloat16, 'cuda', tied=True); write_tokenizer(p, cfg.vocab_size); print(p)"
echo "== batch27"; timeout 300 python -m bench.batch --model /dev/shm/m27 --concurrency 1,2,4,8 --spec off,mtp --no-exact --join 32768 --out $OUT > $OUT/batch27.txt 2>&1; echo rc=$?; grep -v '^{"bench"' $OUT/batch27.txt | tail -14 | cut -c1-400
