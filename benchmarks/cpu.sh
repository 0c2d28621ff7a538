#!/bin/bash
# Regenerates benchmarks/cpu/ on a CPU machine, default model (SmolLM2-135M-Instruct, fp32), after
# `make install`:   bash benchmarks/cpu.sh PART      PART: decode | sweep | all (default: all)
# The HF baseline of the 64-prompt run takes ~20 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
S=.venv/bin/specserve
OUT=${OUT:-benchmarks/cpu}
decode() {
  $S bench throughput --batch-1 --num-prompts 4 --max-tokens 64 --ignore-eos --baseline hf --dtype float32 --device cpu --json "$OUT/batch1_decode.json"
  $S bench throughput --num-prompts 64 --max-tokens 128 --ignore-eos --baseline hf --dtype float32 --device cpu --json "$OUT/throughput_sharegpt64.json" --plot "$OUT/throughput_sharegpt64.png"
}
sweep() {
  $S bench spec-sweep --method ngram --k 4 --dataset humaneval --concurrency 1,4,16,64 --requests-per-slot 1 --min-requests 8 --max-tokens 96 --dtype float32 --device cpu --repeats 7 --interleave --json "$OUT/spec_sweep_humaneval.json" --plot "$OUT/spec_sweep_humaneval.png"
}
case ${1:-all} in
  decode) decode ;;
  sweep) sweep ;;
  all) decode; sweep ;;
  *) echo "unknown part: $1 (decode | sweep | all)" >&2; exit 2 ;;
esac
