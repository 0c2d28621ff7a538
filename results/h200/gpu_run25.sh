#!/bin/bash
# Session 6, device call 4: the GPU test suite (after do_not_specialize on per-step ints and the
# gc freeze), the 256-request run against HF generate_batch, and the per-step spans again.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout 230 python3 -m pytest -q -m gpu tests/gpu tests/ops tests/model -p no:cacheprovider 2>&1 | grep -v "it/s\]" | tail -8 | tee $OUT/gpu_tests_s6.txt
/usr/bin/time -f "%e s" timeout 110 python3 -m specserve.cli.main bench throughput --model dummy:llama-3.1-8b --dataset random --input-len 512 --input-len-min 32 --max-tokens 256 --ignore-eos --num-prompts 256 --max-num-seqs 256 --dtype bfloat16 --max-model-len 1024 --baseline hf-cb --json $OUT/hfcb_256_llama8b_s6b.json 2>&1 | grep -v "it/s\]" | tail -6
timeout 75 python3 results/h200/diag/workload_diag.py 2>&1 | grep -v "it/s\]" | grep -v "^[0-9]" | tail -6
