#!/bin/bash
# Session 3, device call 2: GEMV tests, matmul shapes (cuBLAS vs GEMV configs, lm_head by rows),
# b1 8B with the GEMV on/off vs the roofline, decode-step profile at batch 256, issue-6 sweep R=0.8.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
M="python3 -m specserve.cli.main bench"
timeout 100 python3 -m pytest -q -m gpu tests/gpu/test_triton_gemv.py -p no:cacheprovider 2>&1 | tail -3
timeout 150 python3 -m specserve.bench.gemm_shapes --json $OUT/gemm_shapes_h200.json 2>&1 | grep -v skip
B="$M throughput --dataset random --input-len 128 --max-tokens 256 --ignore-eos --dtype bfloat16 --max-model-len 4096 --model dummy:llama-3.1-8b --batch-1 --num-prompts 3 --max-num-seqs 8"
timeout 60 $B --json $OUT/b1_llama8b_gemv.json 2>&1 | grep "decode tok/s\|roofline"
SPECSERVE_GEMV=0 timeout 60 $B 2>&1 | grep "decode tok/s\|roofline"
timeout 60 $M profile --model dummy:llama-3.1-8b --batch 1 --top 12 --json $OUT/profile_b1_llama8b_gemv.json 2>&1 | tail -13
timeout 70 $M profile --model dummy:llama-3.1-8b --batch 256 --top 16 --json $OUT/profile_b256_llama8b.json 2>&1 | tail -17
S="$M spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16,64,256 --requests-per-slot 1 --min-requests 8 --repeats 3 --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 20"
timeout 200 $S --acceptance-rate 0.8 --json $OUT/sweep_golden_r08_llama8b.json --plot $OUT/sweep_golden_r08_llama8b.png 2>&1 | grep -v "it/s\]" | tail -21
