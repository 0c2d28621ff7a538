#!/bin/bash
# Prepared in session 8 for the next session (not run yet): the GPU suite on the final
# session-8 code, then the 256-request run against HF generate_batch (PDL in the fused kernels is
# new since session 7's 14.9x) and SmolLM2-135M batch 1 (the GEMV at K = 576).
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout 330 python3 -m pytest -q -m gpu tests/gpu tests/ops tests/model -p no:cacheprovider 2>&1 | grep -v "it/s\]" | tail -8 | tee $OUT/gpu_tests_s9.txt
M="python3 -m specserve.cli.main bench throughput"
timeout 150 $M --model dummy:llama-3.1-8b --dataset random --input-len 512 --input-len-min 32 --max-tokens 256 --ignore-eos --num-prompts 256 --max-num-seqs 256 --dtype bfloat16 --max-model-len 1024 --baseline hf-cb --json $OUT/hfcb_256_llama8b_s9a.json 2>&1 | grep -v "it/s\]" | tail -6
timeout 60 $M --dataset random --input-len 128 --max-tokens 256 --ignore-eos --dtype bfloat16 --max-model-len 4096 --model dummy:smollm2-135m --batch-1 --num-prompts 3 --max-num-seqs 8 --json $OUT/b1_smollm2_s9a.json 2>&1 | grep "decode tok/s\|roofline"
