#!/bin/bash
# Regenerates benchmarks/cpu/ on a CPU machine, default model (SmolLM2-135M-Instruct, fp32), after
# `make install`:   bash benchmarks/cpu.sh PART      PART: decode | sweep | host | all (default: all)
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
# host microseconds per decode step by phase, batch 1 and 256 (host_profile_ab.json: this run
# against the commit before the host-work changes, alternated, see its "what")
host() {
  for c in generate stream; do
    $S bench host-profile --consumer $c --batch-sizes 1,256 --json "$OUT/host_profile_$c.json"
  done
}
case ${1:-all} in
  decode) decode ;;
  sweep) sweep ;;
  host) host ;;
  all) decode; sweep; host ;;
  *) echo "unknown part: $1 (decode | sweep | host | all)" >&2; exit 2 ;;
esac
