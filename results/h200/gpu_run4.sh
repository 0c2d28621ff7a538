#!/bin/bash
# Session 2, device call 3: tests of the fused kernels/overlap/graphs + engine benchmarks vs HF.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout 170 python3 -m pytest -q -rf -m gpu tests/gpu/test_triton_fused.py tests/gpu/test_overlap.py tests/gpu/test_cuda_graph.py -p no:cacheprovider 2>&1 | grep -v "it/s\]" | tail -12 > $OUT/gpu_tests_b.txt; tail -12 $OUT/gpu_tests_b.txt
B="python3 -m specserve.cli.main bench throughput --dataset random --input-len 128 --max-tokens 256 --ignore-eos --dtype bfloat16 --max-model-len 4096"
timeout 100 $B --model dummy:llama-3.1-8b --batch-1 --num-prompts 3 --max-num-seqs 8 --baseline hf --json $OUT/b1_llama8b.json 2>&1 | grep -v "it/s\]" | tail -5
timeout 70 $B --model dummy:smollm2-135m --batch-1 --num-prompts 3 --max-num-seqs 8 --baseline hf --json $OUT/b1_smollm2.json 2>&1 | grep -v "it/s\]" | tail -5
timeout 170 $B --model dummy:llama-3.1-8b --input-len 512 --input-len-min 32 --num-prompts 256 --max-num-seqs 256 --baseline hf --hf-batch-size 256 --json $OUT/tp256_llama8b.json 2>&1 | grep -v "it/s\]" | tail -5
