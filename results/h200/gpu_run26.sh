#!/bin/bash
# Prepared in session 6 for the next session's first device call (not run yet): the full GPU
# suite (350 s: session 6's 230 s cut it off after 45 tests), the 256-request run against HF
# generate_batch (to confirm the start-up warm-up closes the gap to the 14.8k tok/s diag run).
# The R = 0.5 sweep (~280 s) needs a call of its own.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout 350 python3 -m pytest -q -m gpu tests/gpu tests/ops tests/model -p no:cacheprovider 2>&1 | grep -v "it/s\]" | tail -8 | tee $OUT/gpu_tests_s7.txt
/usr/bin/time -f "%e s" timeout 120 python3 -m specserve.cli.main bench throughput --model dummy:llama-3.1-8b --dataset random --input-len 512 --input-len-min 32 --max-tokens 256 --ignore-eos --num-prompts 256 --max-num-seqs 256 --dtype bfloat16 --max-model-len 1024 --baseline hf-cb --json $OUT/hfcb_256_llama8b_s7a.json 2>&1 | grep -v "it/s\]" | tail -6
