#!/bin/bash
# Session 9, call 2: split-KV merged inside the attention kernel (no combine launch) and one
# kernel for rotary + KV write (one launch fewer per layer). Batch-1 8B decode on this code and
# on the previous commit's code (ab_prev/, an untracked copy of specserve at 3312756) alternating
# in one call, then the whole GPU suite.
export SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
B="python3 -m specserve.cli.main bench throughput --dataset random --input-len 128 --max-tokens 256 --ignore-eos --dtype bfloat16 --max-model-len 4096 --model dummy:llama-3.1-8b --batch-1 --num-prompts 3 --max-num-seqs 8"
for r in a; do
  PYTHONPATH=$PWD timeout 60 $B --json $OUT/b1_llama8b_s9$r.json 2>&1 | grep "decode tok/s\|roofline"
  (cd ab_prev && PYTHONPATH=$PWD timeout 60 $B --json $OUT/b1_llama8b_prev_s9$r.json 2>&1 | grep "decode tok/s\|roofline")
done
PYTHONPATH=$PWD timeout 90 python3 results/h200/diag/attn_decode_tiles.py 2>&1 | tail -9
PYTHONPATH=$PWD timeout 330 python3 -m pytest -q -m gpu tests/gpu tests/ops tests/model -p no:cacheprovider 2>&1 | grep -v "it/s\]" | tail -8 | tee $OUT/gpu_tests_s9.txt
