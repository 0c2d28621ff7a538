#!/bin/bash
# Session 3, device call 4: issue-6 sweeps with the decode-shaped graphs, padded step-cost curve,
# interleaved modes; eager ops of the 256-request run (what is the 2.7 ms GEMM per decode step?).
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
M="python3 -m specserve.cli.main bench"
timeout 100 $M profile --model dummy:llama-3.1-8b --workload 256 --input-len 512 --input-len-min 32 --max-tokens 256 --dtype bfloat16 --top 6 --ops 2>&1 | grep -v Warn | tail -24
S="$M spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16,64,256 --requests-per-slot 1 --min-requests 8 --repeats 3 --interleave --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 12"
timeout 220 $S --acceptance-rate 0.8 --json $OUT/sweep_golden_r08_llama8b.json --plot $OUT/sweep_golden_r08_llama8b.png 2>&1 | grep -v "it/s\]" | tail -20
timeout 220 $S --acceptance-rate 0.5 --json $OUT/sweep_golden_r05_llama8b.json --plot $OUT/sweep_golden_r05_llama8b.png 2>&1 | grep -v "it/s\]" | tail -20
