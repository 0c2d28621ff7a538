#!/bin/bash
# Session 12, final code: the whole GPU suite (calibration now measures verify- and
# decode-shaped curves; host overhead per load; probes back off), then the R = 0.5 sweep (the
# probe backoff acts only where plain decoding wins: R = 0.5, C >= 64).
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout 330 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider tests/gpu tests/ops tests/model 2>&1 | grep -v "it/s\]" > $OUT/gpu_tests_s12.txt
echo "pytest rc ${PIPESTATUS[0]}"; tail -6 $OUT/gpu_tests_s12.txt
SWEEP_RS=0.5 SWEEP_TAG=c timeout 260 bash results/h200/gpu_run55.sh
