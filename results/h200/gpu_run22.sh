#!/bin/bash
# Session 6, device call 1: R = 0.5 and R = 0.8 sweeps (two requests per slot, as gpu_run20.sh)
# on the final session-5 code (2x clamp, CPU line, exact largest bucket: never run on the GPU).
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
S="python3 -m specserve.cli.main bench spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16,64,256 --requests-per-slot 2 --min-requests 8 --repeats 5 --interleave --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 12"
for R in 05 08; do
  N=sweep_golden_r${R}_llama8b_s6a
  /usr/bin/time -f "%e s" timeout 280 $S --acceptance-rate 0.${R#0} --json $OUT/$N.json --plot $OUT/$N.png 2>&1 | grep -v "it/s\]" | grep "C=\|Error\|error\| s$" | tail -22
done
