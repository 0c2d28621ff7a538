#!/bin/bash
# Prepared in session 12 for the next session (not run yet; run gpu_run56.sh, the GPU suite, first:
# the drain backoff in spec/speculator.py came after it). One sweep per call, 9 interleaved
# repeats (5 left verdicts at the mercy of one drifting host: gpu_run55's R = 0.8 missed C = 1
# and 16 by medians with exactly fixed k's steps, paired ratios 0.989 and 0.979). ~400 s each:
#   SWEEP_R=0.8 bash results/h200/gpu_run58.sh   and then   SWEEP_R=0.5 bash results/h200/gpu_run58.sh
# (session 13 ran both as _s13_r9; then, after the check moved to paired ratios, a fresh
#   SWEEP_R=0.8 SWEEP_TAG=s13b_r9 bash results/h200/gpu_run58.sh)
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
R=${SWEEP_R:-0.8}
N=sweep_golden_r0${R#0.}_llama8b_${SWEEP_TAG:-s13_r9}
timeout 580 python3 -m specserve.cli.main bench spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16,64,256 --requests-per-slot 2 --min-requests 8 --repeats 9 --interleave --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 12 --acceptance-rate $R --json $OUT/$N.json --plot $OUT/$N.png 2>&1 | grep -v "it/s\]" | grep "C=\|Error\|error" | tail -22
