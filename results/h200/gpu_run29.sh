#!/bin/bash
# Session 7, device call 4: both sweeps with the golden drafter's per-(request, position) draws
# (every mode and repeat meets the same right and wrong drafts), and the batch-1 microbenchmark
# (GEMM layouts at one row, attention split counts at batch 1).
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
S="python3 -m specserve.cli.main bench spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16,64,256 --requests-per-slot 2 --min-requests 8 --repeats 5 --interleave --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 12"
N=sweep_golden_r08_llama8b_s7b
/usr/bin/time -f "%e s" timeout 240 $S --acceptance-rate 0.8 --json $OUT/$N.json --plot $OUT/$N.png 2>&1 | grep -v "it/s\]" | grep "C=\|Error\|error\| s$" | tail -22
timeout 80 python3 results/h200/diag/b1_micro.py 2>&1 | grep -v "it/s\]" | tail -14
N=sweep_golden_r05_llama8b_s7b
/usr/bin/time -f "%e s" timeout 235 $S --acceptance-rate 0.5 --json $OUT/$N.json --plot $OUT/$N.png 2>&1 | grep -v "it/s\]" | grep "C=\|Error\|error\| s$" | tail -22
