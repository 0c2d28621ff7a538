#!/bin/bash
# Session 7, device call 3: the R = 0.8 sweep after "a step without drafts runs overlapped", and
# a second 256-request run against HF generate_batch (call 1 gave 14.91x).
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
S="python3 -m specserve.cli.main bench spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16,64,256 --requests-per-slot 2 --min-requests 8 --repeats 5 --interleave --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 12"
N=sweep_golden_r08_llama8b_s7a
/usr/bin/time -f "%e s" timeout 330 $S --acceptance-rate 0.8 --json $OUT/$N.json --plot $OUT/$N.png 2>&1 | grep -v "it/s\]" | grep "C=\|Error\|error\| s$" | tail -22
/usr/bin/time -f "%e s" timeout 150 python3 -m specserve.cli.main bench throughput --model dummy:llama-3.1-8b --dataset random --input-len 512 --input-len-min 32 --max-tokens 256 --ignore-eos --num-prompts 256 --max-num-seqs 256 --dtype bfloat16 --max-model-len 1024 --baseline hf-cb --json $OUT/hfcb_256_llama8b_s7b.json 2>&1 | grep -v "it/s\]" | tail -5
