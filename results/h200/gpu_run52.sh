#!/bin/bash
# Session 11, final code: the whole GPU suite (the verify budget changed, no kernel did), then the
# per-decision log at R = 0.8, C = 16 and 64 (gpu_run49: auto took 107 steps per run at C = 64
# where fixed k took 89, with no trim choosing plain; which decisions kept nothing?).
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout 420 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider tests/gpu tests/ops tests/model 2>&1 | grep -v "it/s\]" > $OUT/gpu_tests_s11.txt
echo "pytest rc ${PIPESTATUS[0]}"; tail -6 $OUT/gpu_tests_s11.txt
DIAG_R=0.8 DIAG_LEVELS=16,64 DIAG_REPEATS=3 timeout 150 python3 results/h200/diag/choice_diag.py 2>&1 | grep -v "it/s\]" | tail -4
mv $OUT/choice_diag.json $OUT/choice_diag_r08_s11.json 2>/dev/null
