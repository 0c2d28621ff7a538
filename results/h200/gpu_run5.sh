#!/bin/bash
# Session 2, device call 4: two-phase verify kernel tests, sync guard, issue-6 sweep (golden drafts), batch-1 8B.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout 110 python3 -m pytest -q -rf -m gpu tests/gpu/test_triton_verify.py tests/gpu/test_overlap.py -p no:cacheprovider 2>&1 | grep -v "it/s\]" | tail -6 > $OUT/gpu_tests_c.txt; tail -4 $OUT/gpu_tests_c.txt
S="python3 -m specserve.cli.main bench spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16,64,256 --requests-per-slot 1 --min-requests 4 --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 20"
timeout 200 $S --acceptance-rate 0.8 --json $OUT/sweep_golden_r08_llama8b.json --plot $OUT/sweep_golden_r08_llama8b.png 2>&1 | grep -v "it/s\]" | tail -12
timeout 45 python3 -m specserve.cli.main bench throughput --dataset random --input-len 128 --max-tokens 256 --ignore-eos --dtype bfloat16 --max-model-len 4096 --model dummy:llama-3.1-8b --batch-1 --num-prompts 3 --max-num-seqs 8 --json $OUT/b1_llama8b_ours.json 2>&1 | grep -v "it/s\]" | tail -3
timeout 170 $S --acceptance-rate 0.5 --json $OUT/sweep_golden_r05_llama8b.json --plot $OUT/sweep_golden_r05_llama8b.png 2>&1 | grep -v "it/s\]" | tail -12
