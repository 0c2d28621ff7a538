#!/bin/bash
# Session 7, device call 5 (the last ~250 s of budget): the R = 0.8 sweep, reduced to C <= 64 and
# 3 repeats, after the sync-overhead fix (no idle gap measured, capped at the step) and the plain
# curve fix (only steps queued behind another). Call 4's R = 0.8 run paused speculation at C = 1.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
S="python3 -m specserve.cli.main bench spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16,64 --requests-per-slot 2 --min-requests 8 --repeats 3 --interleave --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 12"
N=sweep_golden_r08_llama8b_s7c
/usr/bin/time -f "%e s" timeout 165 $S --acceptance-rate 0.8 --json $OUT/$N.json 2>&1 | grep -v "it/s\]" | grep "C=\|Error\|error\| s$" | tail -22
