#!/bin/bash
# Prepared in session 10 for the next session (not run yet): per-decision log of the auto engine
# at R = 0.5, C = 16 then 64 (results/h200/diag/choice_diag.py): does it speculate at full load,
# is the plain price measured there, and how far do real synchronous periods run above their
# price (the period biases). ~90-150 s.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
DIAG_R=0.5 DIAG_LEVELS=16,64 DIAG_REPEATS=3 timeout 400 python3 results/h200/diag/choice_diag.py 2>&1 | grep -v "it/s\]" | tail -8
