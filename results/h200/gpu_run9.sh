#!/bin/bash
# Session 3, device call 3: lm_head outside the graphs, verify-budget per-step cost fixes.
# b1 8B vs roofline, b1 graph-mode profile, the 256-request workload profile, issue-6 sweeps.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
M="python3 -m specserve.cli.main bench"
B="$M throughput --dataset random --input-len 128 --max-tokens 256 --ignore-eos --dtype bfloat16 --max-model-len 4096 --model dummy:llama-3.1-8b --batch-1 --num-prompts 3 --max-num-seqs 8"
timeout 60 $B --json $OUT/b1_llama8b_roofline.json 2>&1 | grep "decode tok/s\|roofline"
timeout 60 $M profile --model dummy:llama-3.1-8b --batch 1 --graphs --max-model-len 4096 --dtype bfloat16 --top 16 --json $OUT/profile_b1_llama8b_graphs.json 2>&1 | tail -17
timeout 100 $M profile --model dummy:llama-3.1-8b --workload 256 --input-len 512 --input-len-min 32 --max-tokens 256 --dtype bfloat16 --top 12 --json $OUT/profile_256_llama8b.json 2>&1 | tail -16
S="$M spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16,64,256 --requests-per-slot 1 --min-requests 8 --repeats 3 --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 20"
timeout 150 $S --acceptance-rate 0.8 --json $OUT/sweep_golden_r08_llama8b.json --plot $OUT/sweep_golden_r08_llama8b.png 2>&1 | grep -v "it/s\]" | tail -5
timeout 150 $S --acceptance-rate 0.5 --json $OUT/sweep_golden_r05_llama8b.json --plot $OUT/sweep_golden_r05_llama8b.png 2>&1 | grep -v "it/s\]" | tail -5
