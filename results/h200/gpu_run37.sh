#!/bin/bash
# (Ran on commit b21dfb9. That change, PDL for the KV write, attention and combine kernels, was
# reverted afterwards: no gain at batch 1 (219.4 vs 220.4 tok/s with PDL on the fused kernels and
# GEMVs only) and its CUDA-graph and overlap tests did not finish inside the 170 s limit.)
# Session 8, call 5 (last of the budget): the KV write, attention and split-combine kernels
# launch with PDL too. Batch-1 8B with and without GEMV+PDL, the GPU tests these kernels touch,
# then the R = 0.8 golden sweep with the verify budget's decode-only pricing.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
M="python3 -m specserve.cli.main bench"
B="$M throughput --dataset random --input-len 128 --max-tokens 256 --ignore-eos --dtype bfloat16 --max-model-len 4096 --model dummy:llama-3.1-8b --batch-1 --num-prompts 3 --max-num-seqs 8"
timeout 60 $B --json $OUT/b1_llama8b_gemv_pdl_s8c.json 2>&1 | grep "decode tok/s\|roofline"
SPECSERVE_GEMV=0 SPECSERVE_PDL=0 timeout 60 $B --json $OUT/b1_llama8b_cublas_s8c.json 2>&1 | grep "decode tok/s\|roofline"
timeout 170 python3 -m pytest -q -m gpu tests/gpu/test_triton_attention.py tests/gpu/test_triton_gemv.py tests/gpu/test_cuda_graph.py tests/gpu/test_overlap.py -p no:cacheprovider 2>&1 | grep -v "it/s\]" | tail -4 | tee $OUT/gpu_tests_s8b.txt
S="$M spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency 1,4,16,64,256 --requests-per-slot 2 --min-requests 8 --repeats 5 --interleave --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 12"
N=sweep_golden_r08_llama8b_s8b
/usr/bin/time -f "%e s" timeout 260 $S --acceptance-rate 0.8 --json $OUT/$N.json --plot $OUT/$N.png 2>&1 | grep -v "it/s\]" | grep "C=\|Error\|error\| s$" | tail -22
