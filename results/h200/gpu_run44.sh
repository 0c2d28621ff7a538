#!/bin/bash
# Prepared in session 9 for the next session's first device call (not run yet): the whole GPU
# suite on the final session-9 code with -rf (session 9 ran it in parts: 169/170 and 21/22, the
# failing check rewritten after the budget ran out), then batch-1 8B decode twice.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout 450 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider tests/gpu tests/ops tests/model 2>&1 | grep -v "it/s\]" > $OUT/gpu_tests_s10.txt
echo "pytest rc ${PIPESTATUS[0]}"; tail -12 $OUT/gpu_tests_s10.txt
B="python3 -m specserve.cli.main bench throughput --dataset random --input-len 128 --max-tokens 256 --ignore-eos --dtype bfloat16 --max-model-len 4096 --model dummy:llama-3.1-8b --batch-1 --num-prompts 3 --max-num-seqs 8"
for r in a b; do timeout 60 $B --json $OUT/b1_llama8b_s10$r.json 2>&1 | grep "decode tok/s\|roofline"; done
