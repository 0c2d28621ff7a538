#!/bin/bash
# Session 2, device call 2: GPU tests, golden-token speculation curve, device idle at batch 64, step profile.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout 300 python3 -m pytest -q -rf -m gpu tests/gpu tests/ops tests/model -p no:cacheprovider --durations=8 2>&1 | grep -v "it/s\]" | tail -40 > $OUT/gpu_tests.txt; tail -40 $OUT/gpu_tests.txt
timeout 150 python3 -m specserve.cli.main bench golden-curve --model dummy:llama-3.1-8b --k 4 --acceptance-rates 0,0.5,0.8,1.0 --batch-sizes 1,16,64 --input-len 128 --max-tokens 256 --repeats 2 --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 16 --json $OUT/golden_curve_llama8b.json --plot $OUT/golden_curve_llama8b.png 2>&1 | grep -v "it/s\]" | tail -25
timeout 80 python3 -m specserve.bench.device_idle --model dummy:llama-3.1-8b --batch 64 --max-tokens 128 --json $OUT/idle_b64_llama8b.json 2>&1 | tail -3
timeout 50 python3 -m specserve.bench.profile_step --model dummy:llama-3.1-8b --batch 1 --json $OUT/profile_b1_llama8b.json 2>&1 | tail -28
