#!/bin/bash
# Session 11, final code (probes every 512 steps; no drafts while prompts being admitted raise
# the load to where plain wins): R = 0.8 at all levels, then R = 0.5 at C = 16, 64, 256 (C = 1
# and 4 are untouched by the changes; the device budget holds ~420 s). gpu_run51 on the code
# before: R = 0.5 C = 64 0.929 of off (probes every 128 steps), R = 0.8 C = 256 0.980 of off
# (~5 synchronous prompt-filled steps per run).
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
run() {  # R, levels, name, timeout
  timeout $4 python3 -m specserve.cli.main bench spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len 128 --max-tokens 128 --concurrency $2 --requests-per-slot 2 --min-requests 8 --repeats 5 --interleave --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 12 --acceptance-rate $1 --json $OUT/$3.json --plot $OUT/$3.png 2>&1 | grep -v "it/s\]" | grep "C=\|Error\|error" | tail -22
}
run 0.8 1,4,16,64,256 sweep_golden_r08_llama8b_s11c 250
run 0.5 16,64,256 sweep_golden_r05_llama8b_s11c_c16_256 190
