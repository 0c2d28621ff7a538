#!/bin/bash
# Session 4, device call 2: issue-6 sweeps (golden drafts, 8B, interleaved, median of 3) on the
# step-cost model with the context term (f(rows) + kv_cost * context tokens).
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
S="python3 -m specserve.cli.main bench spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16,64,256 --requests-per-slot 1 --min-requests 8 --repeats 3 --interleave --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 12"
for R in 0.5 0.8; do
  N=sweep_golden_r0${R#0.}_llama8b_s4
  timeout 280 $S --acceptance-rate $R --json $OUT/$N.json --plot $OUT/$N.png 2>&1 | grep -v "it/s\]" | grep "C=\|kv_cost\|Error\|error" | tail -22
done
