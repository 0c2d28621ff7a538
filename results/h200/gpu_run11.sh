#!/bin/bash
# Session 3, device call 5: the GPU test suite on the final code (decode-shaped graphs, eager
# lm_head), then the issue-6 low-load points at R = 0.5 after the pause fix.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout 230 python3 -m pytest -q -x -m gpu tests/gpu tests/ops tests/model -p no:cacheprovider 2>&1 | grep -v "it/s\]" | tail -8 | tee $OUT/gpu_tests_s3.txt
S="python3 -m specserve.cli.main bench spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16 --requests-per-slot 1 --min-requests 8 --repeats 3 --interleave --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 12"
timeout 150 $S --acceptance-rate 0.5 --json $OUT/sweep_golden_r05_low_llama8b.json 2>&1 | grep -v "it/s\]" | tail -12
