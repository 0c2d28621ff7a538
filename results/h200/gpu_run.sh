#!/bin/bash
# one device call: GPU tests + engine benchmarks vs HF (results under $OUT)
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a $OUT/gpu.txt
B="python3 -m specserve.cli.main bench throughput --dataset random --input-len 128 --max-tokens 256 --ignore-eos --dtype bfloat16 --max-model-len 4096"
timeout 150 $B --model dummy:llama-3.1-8b --batch-1 --num-prompts 3 --max-num-seqs 8 --baseline hf --json $OUT/b1_llama8b.json 2>&1 | grep -v "it/s\]" | tail -8
timeout 90 $B --model dummy:smollm2-135m --batch-1 --num-prompts 3 --max-num-seqs 8 --baseline hf --json $OUT/b1_smollm2.json 2>&1 | grep -v "it/s\]" | tail -8
timeout 200 $B --model dummy:llama-3.1-8b --input-len 512 --input-len-min 32 --num-prompts 256 --max-num-seqs 256 --baseline hf --hf-batch-size 256 --json $OUT/tp256_llama8b.json 2>&1 | grep -v "it/s\]" | tail -8
timeout 200 python3 -m pytest -q -m gpu tests/ops tests/model tests/gpu -p no:cacheprovider 2>&1 | tail -4 | tee $OUT/gpu_tests.log
