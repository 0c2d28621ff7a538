#!/bin/bash
# Session 2, device call 5: issue-6 sweep after the overlapped plain-decoding curve (golden drafts, R = 0.5 and 0.8).
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
S="python3 -m specserve.cli.main bench spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16,64,256 --requests-per-slot 1 --min-requests 4 --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 20"
timeout 160 $S --acceptance-rate 0.5 --json $OUT/sweep_golden_r05_llama8b.json --plot $OUT/sweep_golden_r05_llama8b.png 2>&1 | grep -v "it/s\]" | tail -16
timeout 140 $S --acceptance-rate 0.8 --json $OUT/sweep_golden_r08_llama8b.json --plot $OUT/sweep_golden_r08_llama8b.png 2>&1 | grep -v "it/s\]" | tail -16
