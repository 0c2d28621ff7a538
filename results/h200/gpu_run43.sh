#!/bin/bash
# Session 9, call 5 (the last ~300 s of device budget): the model-level fused test whose bf16
# qk-norm cache check failed in call 3 (now at the logits' tolerance), then SmolLM2-135M batch 1
# with and without the one-row GEMV + PDL (call 4 measured 583 tok/s where session 3 had 930).
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout 60 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider tests/gpu/test_triton_fused.py -k "model_fused or rope_write" 2>&1 | tail -4 | tee $OUT/gpu_tests_s9c.txt
B="python3 -m specserve.cli.main bench throughput --dataset random --input-len 128 --max-tokens 256 --ignore-eos --dtype bfloat16 --max-model-len 4096 --model dummy:smollm2-135m --batch-1 --num-prompts 3 --max-num-seqs 8"
for r in a b; do
  echo "default $r"; timeout 40 $B --json $OUT/b1_smollm2_s9c$r.json 2>&1 | grep "decode tok/s per"
  echo "no GEMV/PDL $r"; SPECSERVE_GEMV=0 SPECSERVE_PDL=0 timeout 40 $B --json $OUT/b1_smollm2_nogemv_s9c$r.json 2>&1 | grep "decode tok/s per"
done
echo "no fused ops"; SPECSERVE_FUSED_OPS=0 timeout 40 $B --json $OUT/b1_smollm2_nofused_s9c.json 2>&1 | grep "decode tok/s per"
