#!/bin/bash
# Session 11, final code (speculation probes while plain wins, cheaper trim): the R = 0.5 and
# R = 0.8 golden sweeps again (gpu_run49 ran session-10 code on a host ~2x slower in Python:
# sync overhead 0.85 ms at C = 16 against 0.38 ms before). ~230 s each.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
for R in 0.5 0.8; do
  N=sweep_golden_r0${R#0.}_llama8b_s11b
  timeout 285 python3 -m specserve.cli.main bench spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16,64,256 --requests-per-slot 2 --min-requests 8 --repeats 5 --interleave --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 12 --acceptance-rate $R --json $OUT/$N.json --plot $OUT/$N.png 2>&1 | grep -v "it/s\]" | grep "C=\|Error\|error" | tail -22
done
