#!/bin/bash
# Prepared in session 10 for the next session (not run yet): the R = 0.5 and R = 0.8 golden
# sweeps on the final session-10 code (PeriodBias: speculation vs plain at real mean periods;
# gpu_run48 had R = 0.5, C = 64 at 0.880 of off before it). ~200-245 s each. Read
# auto_budget[C].verify_budget_{sync,plain}_period_bias in the JSON.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
for R in 0.5 0.8; do
  N=sweep_golden_r0${R#0.}_llama8b_s11
  timeout 280 python3 -m specserve.cli.main bench spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16,64,256 --requests-per-slot 2 --min-requests 8 --repeats 5 --interleave --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 12 --acceptance-rate $R --json $OUT/$N.json --plot $OUT/$N.png 2>&1 | grep -v "it/s\]" | grep "C=\|Error\|error" | tail -22
done
