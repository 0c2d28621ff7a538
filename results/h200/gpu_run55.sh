#!/bin/bash
# Session 12: both sweeps after two pricing fixes found in gpu_run54 (R = 0.8, C = 64: auto
# kept ~186 draft rows per step where fixed k's 217 ran 7 % faster): the host overhead of a
# synchronous step is kept per load (one window over all loads priced C = 64 with C = 16's
# host work after each interleaved switch), and the synchronous curve is calibrated with
# verify-shaped steps (decode-shaped up to 256 rows, it jumped 25 % from 256 to 272 rows).
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
for R in ${SWEEP_RS:-0.8 0.5}; do
  N=sweep_golden_r0${R#0.}_llama8b_s12${SWEEP_TAG:-b}
  timeout 285 python3 -m specserve.cli.main bench spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16,64,256 --requests-per-slot 2 --min-requests 8 --repeats 5 --interleave --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 12 --acceptance-rate $R --json $OUT/$N.json --plot $OUT/$N.png 2>&1 | grep -v "it/s\]" | grep "C=\|Error\|error" | tail -22
done
