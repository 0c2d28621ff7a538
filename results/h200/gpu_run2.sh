#!/bin/bash
# Session 2, device call 1: GPU tests (kernels, graphs, overlap, sync guard) + overlap benchmarks.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a $OUT/gpu.txt
timeout 260 python3 -m pytest -q -m gpu tests/gpu tests/ops tests/model -p no:cacheprovider 2>&1 | grep -v "it/s\]" | tail -25 | tee $OUT/gpu_tests.txt
timeout 100 python3 -m specserve.bench.device_idle --model dummy:llama-3.1-8b --batch 64 --max-tokens 128 --json $OUT/idle_b64_llama8b.json 2>&1 | tail -3
B="python3 -m specserve.cli.main bench throughput --dataset random --input-len 128 --max-tokens 256 --ignore-eos --dtype bfloat16 --max-model-len 4096"
timeout 60 $B --model dummy:llama-3.1-8b --batch-1 --num-prompts 3 --max-num-seqs 8 --json $OUT/b1_llama8b_ours.json 2>&1 | grep -v "it/s\]" | tail -4
timeout 60 $B --model dummy:smollm2-135m --batch-1 --num-prompts 3 --max-num-seqs 8 --json $OUT/b1_smollm2_ours.json 2>&1 | grep -v "it/s\]" | tail -4
