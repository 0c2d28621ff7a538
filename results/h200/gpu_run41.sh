#!/bin/bash
# Session 9, call 3: the GPU tests on the final kernels (split-KV merged in the attention
# kernel, rotary + KV write in one kernel, the wide-grid decode tile). Call 2's suite ran out of
# its time limit after ~158 of 188 tests, with one failure in test_triton_fused (no summary):
# here the files that changed first, with -rf so a failure names itself; test_triton_gemv
# (18 tests, unchanged, passed in call 2) is left out.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout 420 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider \
  tests/gpu/test_triton_fused.py tests/gpu/test_triton_attention.py tests/gpu/test_cuda_graph.py \
  tests/gpu/test_overlap.py tests/gpu/test_triton_verify.py tests/ops 2>&1 | grep -v "it/s\]" > $OUT/gpu_tests_s9b.txt
echo "pytest rc ${PIPESTATUS[0]}"
tail -25 $OUT/gpu_tests_s9b.txt
