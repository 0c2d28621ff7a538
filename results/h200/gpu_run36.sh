#!/bin/bash
# Session 8, call 4: the one-row Triton GEMV under programmatic dependent launch (ops/gemv.py,
# ops/pdl.py) in the model. Its tests first, then batch-1 8B decode with it and without it
# (SPECSERVE_GEMV=0 SPECSERVE_PDL=0: cuBLAS, plain launches) alternating in one call, then the
# whole GPU suite.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_triton_gemv.py tests/gpu/test_triton_fused.py -p no:cacheprovider 2>&1 | tail -4
M="python3 -m specserve.cli.main bench"
B="$M throughput --dataset random --input-len 128 --max-tokens 256 --ignore-eos --dtype bfloat16 --max-model-len 4096 --model dummy:llama-3.1-8b --batch-1 --num-prompts 3 --max-num-seqs 8"
for r in a b; do
  timeout 60 $B --json $OUT/b1_llama8b_gemv_pdl_s8$r.json 2>&1 | grep "decode tok/s\|roofline"
  SPECSERVE_GEMV=0 SPECSERVE_PDL=0 timeout 60 $B --json $OUT/b1_llama8b_cublas_s8$r.json 2>&1 | grep "decode tok/s\|roofline"
done
timeout 330 python3 -m pytest -q -m gpu tests/gpu tests/ops tests/model -p no:cacheprovider 2>&1 | grep -v "it/s\]" | tail -8 | tee $OUT/gpu_tests_s8.txt
