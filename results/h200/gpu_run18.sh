#!/bin/bash
# Session 5, device call 2: why the auto engine's step-cost curve read 3x real at buckets >= 16
# and its plain curve 1.3 ms (R = 0.5 sweep, call 1): start-up samples, re-timed synthetic
# steps and the real steps of C = 1 and C = 4, on the code with f kept positive.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
rm -rf .devcarry/cache/step-cost
timeout 400 python3 results/h200/diag/budget_calib_diag.py 2>&1 | grep -v "it/s\]" | cut -c1-2500 | tail -40
