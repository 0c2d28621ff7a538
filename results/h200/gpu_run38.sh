#!/bin/bash
# Prepared in session 8 for the next session's first device call (not run yet): the R = 0.8
# golden sweep on the final session-8 code (decode-only pricing, the cheaper chooser), then the
# same sweep with OMP_NUM_THREADS=1. On that host a budget decision took ~2.5x what it takes on
# the 2-core CI VM, and synchronous steps' repeats were bimodal: torch's 16 intra-op threads
# competing with the engine thread is the suspect this pair tests. Each sweep ~200-245 s.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
S="python3 -m specserve.cli.main bench spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16,64,256 --requests-per-slot 2 --min-requests 8 --repeats 5 --interleave --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 12 --acceptance-rate 0.8"
N=sweep_golden_r08_llama8b_s9a
/usr/bin/time -f "%e s" timeout 280 $S --json $OUT/$N.json --plot $OUT/$N.png 2>&1 | grep -v "it/s\]" | grep "C=\|Error\|error\| s$" | tail -22
N=sweep_golden_r08_llama8b_s9a_omp1
OMP_NUM_THREADS=1 /usr/bin/time -f "%e s" timeout 280 $S --json $OUT/$N.json --plot $OUT/$N.png 2>&1 | grep -v "it/s\]" | grep "C=\|Error\|error\| s$" | tail -22
