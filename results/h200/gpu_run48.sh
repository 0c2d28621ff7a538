#!/bin/bash
# Session 10: the R = 0.5 golden sweep on the final session-10 code (after
# gpu_run45's R = 0.5 half on the session-9 code; golden confidences are given, so the exploration change
# does not touch it). ~200-245 s.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
N=sweep_golden_r05_llama8b_s10b
timeout 300 python3 -m specserve.cli.main bench spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16,64,256 --requests-per-slot 2 --min-requests 8 --repeats 5 --interleave --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 12 --acceptance-rate 0.5 --json $OUT/$N.json --plot $OUT/$N.png 2>&1 | grep -v "it/s\]" | grep "C=\|Error\|error" | tail -22
