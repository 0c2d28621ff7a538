#!/bin/bash
# Session 4, device call 4: R = 0.8 sweep after the symmetric unobserved-bucket rule, then the
# GPU test suite on the final code.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
S="python3 -m specserve.cli.main bench spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16,64,256 --requests-per-slot 1 --min-requests 8 --repeats 5 --interleave --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 12"
N=sweep_golden_r08_llama8b_s4c
timeout 200 $S --acceptance-rate 0.8 --json $OUT/$N.json --plot $OUT/$N.png 2>&1 | grep -v "it/s\]" | grep "C=\|Error\|error" | tail -22
timeout 340 python3 -m pytest -q -m gpu tests/gpu tests/ops tests/model -p no:cacheprovider 2>&1 | grep -v "it/s\]" | tail -6 | tee $OUT/gpu_tests_s4_final.txt
