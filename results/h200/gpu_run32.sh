#!/bin/bash
# Prepared in session 7 for the next session (not run yet): the GPU suite on the session-7 code
# (its last run, call 1 of session 7, predates "draft-free steps run overlapped"), then the
# one-row split-K GEMV sweep against cuBLAS for qkv, o_proj and down (diag/gemv_sweep.py).
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout 330 python3 -m pytest -q -m gpu tests/gpu tests/ops tests/model -p no:cacheprovider 2>&1 | grep -v "it/s\]" | tail -8 | tee $OUT/gpu_tests_s8.txt
timeout 240 python3 results/h200/diag/gemv_sweep.py 2>&1 | tail -8
