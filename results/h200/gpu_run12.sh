#!/bin/bash
# Session 4, device call 1: the whole GPU test suite on the code at the start of the session.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,utilization.gpu --format=csv | tee $OUT/gpu_state.txt
timeout 570 python3 -m pytest -q -m gpu tests/gpu tests/ops tests/model -p no:cacheprovider --durations=20 2>&1 | grep -v "it/s\]" | tail -45 | tee $OUT/gpu_tests_s4.txt
