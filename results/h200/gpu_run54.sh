#!/bin/bash
# Prepared in session 11 for the next session (not run yet): both sweeps on the final session-11
# code (the imminent-load verdict as fixed after gpu_run53, where it never fired; a paused
# engine's steps skip the drafter's observe and the decode-shape test runs in C). Read
# auto_budget[C].verify_budget_plain_ahead (> 0 expected at C = 256) and the sync steps per run
# at R = 0.8, C = 256 (5.4 and 3.6 before). ~210-230 s each.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
for R in 0.5 0.8; do
  N=sweep_golden_r0${R#0.}_llama8b_s12
  timeout 285 python3 -m specserve.cli.main bench spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16,64,256 --requests-per-slot 2 --min-requests 8 --repeats 5 --interleave --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 12 --acceptance-rate $R --json $OUT/$N.json --plot $OUT/$N.png 2>&1 | grep -v "it/s\]" | grep "C=\|Error\|error" | tail -22
done
