#!/bin/bash
# Session 9, call 4: the 256-request run against HF generate_batch (the wide-grid decode tile and
# the fused rotary + KV write are new since session 7's 14.9x), SmolLM2-135M batch 1, and the
# R = 0.8 golden sweep at C = 1 and 4 (the verify budget's bookkeeping now runs while the device
# is busy; call 1 missed C = 1 by 0.2-0.6 % with the same decisions as fixed k).
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
M="python3 -m specserve.cli.main bench"
timeout 170 $M throughput --model dummy:llama-3.1-8b --dataset random --input-len 512 --input-len-min 32 --max-tokens 256 --ignore-eos --num-prompts 256 --max-num-seqs 256 --dtype bfloat16 --max-model-len 1024 --baseline hf-cb --json $OUT/hfcb_256_llama8b_s9a.json 2>&1 | grep -v "it/s\]" | tail -5
timeout 60 $M throughput --dataset random --input-len 128 --max-tokens 256 --ignore-eos --dtype bfloat16 --max-model-len 4096 --model dummy:smollm2-135m --batch-1 --num-prompts 3 --max-num-seqs 8 --json $OUT/b1_smollm2_s9a.json 2>&1 | grep "decode tok/s\|roofline"
N=sweep_golden_r08_llama8b_s9b_c1_4
timeout 200 $M spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4 --requests-per-slot 2 --min-requests 8 --repeats 5 --interleave --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 12 --acceptance-rate 0.8 --json $OUT/$N.json --plot $OUT/$N.png 2>&1 | grep -v "it/s\]" | grep "C=\|Error\|error" | tail -12
