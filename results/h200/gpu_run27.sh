#!/bin/bash
# Session 7, device call 2: the paused-mode diagnostic at R = 0.5, C = 64 (off vs auto, every
# step's launch kind), then the R = 0.5 sweep, after "a step without drafts runs overlapped".
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout 150 python3 results/h200/diag/pause_diag.py 2>&1 | grep -v "it/s\]" | tail -24
S="python3 -m specserve.cli.main bench spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16,64,256 --requests-per-slot 2 --min-requests 8 --repeats 5 --interleave --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 12"
N=sweep_golden_r05_llama8b_s7a
/usr/bin/time -f "%e s" timeout 330 $S --acceptance-rate 0.5 --json $OUT/$N.json --plot $OUT/$N.png 2>&1 | grep -v "it/s\]" | grep "C=\|Error\|error\| s$" | tail -22
