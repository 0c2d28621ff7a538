#!/bin/bash
# Session 12, final code: the whole GPU suite (calibration now measures verify- and
# decode-shaped curves; host overhead per load; probes back off).
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout 560 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider tests/gpu tests/ops tests/model 2>&1 | grep -v "it/s\]" > $OUT/gpu_tests_s12.txt
echo "pytest rc ${PIPESTATUS[0]}"; tail -6 $OUT/gpu_tests_s12.txt
