#!/bin/bash
# Regenerates benchmarks/h200/ on one NVIDIA H200. Each part fits one 10-minute device command:
#   here:       make devcarry          (tokenizer + ShareGPT pairs into .devcarry/, the wheels the image lacks into .whl/; ignored by git)
#   on the GPU: bash benchmarks/h200.sh PART      with .devcarry carried; results land in $OUT
#   the real default model: python tools/devcarry.py --gguf-parts, then `h200.sh gguf1` carrying
#   .devcarry-gguf1 alone (a part and .devcarry outgrow one call), likewise gguf2 and gguf3, back
#   to back while the machine is warm (a carried path is gone in the next call unless carried
#   again; /tmp stays); the parts after them carry .devcarry (and .whl) again
# PART: tests | decode | sweep05 | sweep08 | sweep10 | curve | idle | profile | gguf1..3 | train-head |
#   train-data | train-head-resume | eagle | trace | split | mixed | steps | modes | catchup | linears | rows | host | anchor | structured (default: decode)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/h200}
S="python3 -m specserve.cli.main"
B1="bench throughput --dataset random --input-len 128 --max-tokens 256 --ignore-eos --dtype bfloat16 --max-model-len 4096 --batch-1 --num-prompts 3 --max-num-seqs 8"
# the sweeps' three 8B engines need ~84 GB: on an 80 GB H100, KV_GB=7.5 INPUT_LEN=96 (C = 256 still fits)
SWEEP="bench spec-sweep --model dummy:llama-3.1-8b --method golden --k 4 --dataset random --input-len ${INPUT_LEN:-128} --max-tokens 128 --concurrency ${CONC:-1,4,16,64,256} --requests-per-slot 2 --min-requests 8 --repeats ${REPEATS:-9} --interleave --dtype bfloat16 --max-model-len 1024 --kv-cache-gb ${KV_GB:-12}"
# the wheels the image lacks (gguf, xgrammar, jsonschema for the GPU tests, and theirs), when .whl
# was carried
if [ -d .whl ] && [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && touch /tmp/site/.installed
fi
[ -d /tmp/site ] && export PYTHONPATH=$PYTHONPATH:/tmp/site
join_gguf() {  # the default model's GGUF from the parts the gguf1..3 calls left in /tmp
  local m=.devcarry/cache/models
  mkdir -p $m
  cat /tmp/gguf/*.part1 /tmp/gguf/*.part2 /tmp/gguf/*.part3 > $m/SmolLM2-135M-Instruct.Q4_1.gguf
}
TRAIN=/tmp/train-head  # outlives the call while the machine stays warm (eagle reads the head)
HEAD=$TRAIN/head
# a step of 64 decodes and a 150-token prompt (host profile, then kernels); E: with the shipped head
M="tools/profile_step.py --model dummy:smollm2-135m --batch 64 --graphs --steps 10 --input-len 150 --dtype bfloat16 --max-model-len 2048 --top 25 --mixed"
E='{"method":"eagle3","model":"specserve/heads/smollm2-135m-instruct","num_speculative_tokens":5,"verify_budget":"off"}'
EAGLE="bench spec-sweep --method eagle3 --k 5 --concurrency ${EAGLE_C:-1,16} --requests-per-slot 2 --min-requests 8 --max-tokens 256 --repeats ${REPEATS:-5} --interleave --modes ${MODES:-off,fixed,auto} ${DEVICE_TIME:+--device-time} --dtype bfloat16 --max-model-len 2048 --kv-cache-gb 4"
case ${1:-decode} in
  tests)  # the GPU test suite (~4 min): engine tests in order, the rest 6 at a time beside them
    P="python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider"
    E="cuda_graph overlap device_drafting eagle3 logits_processing_gpu verify_budget_gpu"
    timeout 560 $P -n 6 tests/gpu tests/ops tests/model $(for e in $E; do echo --ignore=tests/gpu/test_$e.py; done) \
      > "$OUT/gpu_kernel_tests.txt" 2>&1 &
    timeout 560 $P --durations=10 $(for e in $E; do echo tests/gpu/test_$e.py; done) 2>&1 \
      | grep -v "it/s\]" > "$OUT/gpu_tests.txt"
    wait
    tail -n 3 "$OUT/gpu_tests.txt" "$OUT/gpu_kernel_tests.txt" ;;
  decode)  # batch-1 decode against the copy-bandwidth roofline; 256 requests against HF continuous batching
    $S $B1 --model dummy:llama-3.1-8b --json "$OUT/b1_llama8b.json"
    $S $B1 --model dummy:smollm2-135m --json "$OUT/b1_smollm2.json"
    $S bench throughput --model dummy:llama-3.1-8b --dataset random --input-len 512 --input-len-min 32 --max-tokens 256 --ignore-eos --num-prompts 256 --max-num-seqs 256 --dtype bfloat16 --max-model-len 1024 --baseline hf-cb --json "$OUT/throughput256_llama8b.json"
    $S bench plot "$OUT/b1_llama8b.json" "$OUT/b1_smollm2.json" "$OUT/throughput256_llama8b.json" --out "$OUT/specserve_vs_hf.png" ;;
  sweep05) $S $SWEEP --acceptance-rate 0.5 --json "$OUT/spec_sweep_golden_r05.json" --plot "$OUT/spec_sweep_golden_r05.png" ;;
  sweep08) $S $SWEEP --acceptance-rate 0.8 --json "$OUT/spec_sweep_golden_r08.json" --plot "$OUT/spec_sweep_golden_r08.png" ;;
  sweep10) $S $SWEEP --acceptance-rate 1.0 --concurrency 1,16 --json "$OUT/spec_sweep_golden_r10.json" ;;
  curve)
    $S bench golden-curve --model dummy:llama-3.1-8b --k 4 --acceptance-rates 0,0.5,0.8,1.0 --batch-sizes 1,16,64 --input-len 128 --max-tokens 256 --repeats 2 --dtype bfloat16 --max-model-len 1024 --kv-cache-gb 16 --json "$OUT/golden_curve_llama8b.json" --plot "$OUT/golden_curve_llama8b.png" ;;
  idle)
    python3 tools/device_idle.py --model dummy:llama-3.1-8b --batch 64 --max-tokens 128 --json "$OUT/idle_b64_llama8b.json"
    python3 tools/device_idle.py --model dummy:llama-3.1-8b --batch 64 --max-tokens 128 --golden-rate 0.8 --json "$OUT/idle_b64_llama8b_golden08.json" ;;
  mixed)  # the mixed-bucket graphs' GPU tests, then steps with a prompt chunk (64 decodes + a
    # 150-token prompt each step), eager against mixed-bucket graphs, plain and with the shipped
    # head's chain (~5 min)
    timeout 240 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider tests/gpu/test_cuda_graph.py \
      tests/gpu/test_eagle3.py -k "mixed or bit_identical or graphs_match_eager" > "$OUT/gpu_tests_mixed.txt" 2>&1
    tail -n 3 "$OUT/gpu_tests_mixed.txt"
    for g in 0 1; do
      # the whole output keeps the host's profile (cProfile) beside the kernels
      SPECSERVE_MIXED_GRAPHS=$g python3 $M --json "$OUT/profile_mixed_smollm2_graphs$g.json" > "$OUT/profile_mixed_smollm2_graphs$g.txt"
      SPECSERVE_MIXED_GRAPHS=$g python3 $M --speculative-config "$E" --json "$OUT/profile_mixed_eagle3_smollm2_graphs$g.json" > "$OUT/profile_mixed_eagle3_smollm2_graphs$g.txt"
      grep -h "wall time" "$OUT"/profile_mixed_*graphs$g.txt
    done ;;
  profile)
    python3 tools/profile_step.py --model dummy:llama-3.1-8b --batch 1 --graphs --max-model-len 4096 --dtype bfloat16 --top 16 --json "$OUT/profile_b1_llama8b.json"
    python3 tools/profile_step.py --model dummy:llama-3.1-8b --batch 256 --top 16 --json "$OUT/profile_b256_llama8b.json" ;;
  gguf1|gguf2|gguf3) mkdir -p /tmp/gguf && cp .devcarry-$1/* /tmp/gguf/ ;;
  train-data) mkdir -p /tmp/train-data && cp .devcarry-train/* /tmp/train-data/ ;;
  train-head|train-head-resume)  # the default model's EAGLE-3 head, trained on its own answers
    # over two calls (~15 min): the first answers every training prompt (14k ShareGPT first
    # turns and 4k coding tasks, ~5 min) and starts training, the next (train-head-resume, run
    # again until report.json exists) trains to 600 s in all, calibrates and evaluates
    # a machine lost between the calls loses /tmp: the first call also returns the answers
    # (train_data.tgz.*, in 12 MB parts, ~25 MB): carry them back as .devcarry-train/ in a call
    # of part train-data (alone: with .devcarry they outgrow a call), then the second call
    # retrains from them
    join_gguf; R=; [ $1 = train-head-resume ] && R=--resume
    if [ -n "$R" ] && [ ! -d $TRAIN/data ] && [ -f /tmp/train-data/train_data.tgz.aa ]; then
      mkdir -p $TRAIN && cat /tmp/train-data/train_data.tgz.* | tar xzf - -C $TRAIN
    fi
    $S train-head --out $TRAIN --num-prompts 14000 --code-prompts 4000 --max-num-seqs 512 --train-seconds 600 --epochs 20 --batch-size 32 --max-tokens-per-batch 16384 --lr 6e-4 --time-limit 530 --no-progress $R
    [ -z "$R" ] && tar czf - -C $TRAIN data | split -b 12m - "$OUT/train_data.tgz."
    if [ -f $TRAIN/report.json ]; then
      cp $TRAIN/report.json "$OUT/train_head_report.json"; cp $TRAIN/train_log.jsonl "$OUT/"
      (cd $HEAD && tar cf - . | split -b 12m - "$OUT/head.tar.")
    fi ;;
  eagle)  # the trained head against no speculation, held-out chat and HumanEval prompts
    # (EAGLE_C=1 REPEATS=2: tokens per step only, ~2 min, where C = 16 and 5 repeats do not fit;
    # DEVICE_TIME=1: each mode's device time by step kind)
    join_gguf; H=self; [ -d $HEAD ] && H=$HEAD  # the head trained in this warm machine, else the shipped one
    $S $EAGLE --draft-model $H --dataset sharegpt-chat --json "$OUT/eagle3_sharegpt_chat.json" --plot "$OUT/eagle3_sharegpt_chat.png"
    $S $EAGLE --draft-model $H --dataset humaneval --json "$OUT/eagle3_humaneval.json" --plot "$OUT/eagle3_humaneval.png" ;;
  trace)  # what the verify budget saw, step by step (tools/budget_trace.py), on HumanEval:
    # EAGLE_C=1 MODES=off,auto REPEATS=2 h200.sh trace (~2 min; after gguf1..3)
    join_gguf; H=self; [ -d $HEAD ] && H=$HEAD
    python3 tools/budget_trace.py --json "$OUT/budget_trace_humaneval.json" -- $EAGLE --draft-model $H --dataset humaneval ;;
  split)  # the device split against the host's (the auto budget both), golden R = 0.5, both shapes (~4 min);
    # EAGLE-3's: EAGLE_C=16,64 MODES=off,fixed,auto,host h200.sh eagle
    G="bench spec-sweep --method golden --k 4 --dataset random --max-tokens 128 --requests-per-slot 2 --min-requests 8 --repeats ${REPEATS:-5} --interleave --modes off,auto,host --dtype bfloat16 --max-model-len 1024 --acceptance-rate 0.5 --concurrency 64,256"
    $S $G --model dummy:llama-3.1-8b --input-len 96 --kv-cache-gb 7.5 --json "$OUT/split_golden_r05_llama8b.json"
    $S $G --model dummy:smollm2-135m --input-len 128 --kv-cache-gb 2 --json "$OUT/split_golden_r05_smollm2.json" ;;
  steps)  # what drafting adds to a step: off / golden k=5 (verify only) / EAGLE-3 k=5, each also sampling eagerly; the drafting choice's cost (~6 min)
    python3 tools/step_cost.py --model dummy:llama-3.1-8b --head random --json "$OUT/step_cost_llama8b.json"
    python3 tools/step_cost.py --model dummy:smollm2-135m --head specserve/heads/smollm2-135m-instruct --json "$OUT/step_cost_smollm2.json"
    # a model drafter's drafting choice forced: never / always / alternating, against off and fixed k
    python3 tools/drafting_modes.py --json "$OUT/drafting_modes_smollm2.json" ;;
  modes)  # a model drafter's plain steps (the budget's choice forced: never draft) against an
    # off engine's, and each one's kernels a step at batch 1 (~3 min)
    python3 tools/drafting_modes.py --batches 1,16 --repeats 5 --kernels off,plain --json "$OUT/drafting_modes_smollm2.json" ;;
  catchup)  # prompt steps with the head: its catch-ups in their rows buckets' graphs, then eager
    # (host profile and wall time per step), after the head's GPU tests (~3 min)
    python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider tests/gpu/test_eagle3.py 2>&1 | tail -3
    for c in graphs eager; do
      python3 $M --speculative-config "$E" $([ $c = eager ] && echo --eager-catch-up) \
        --json "$OUT/profile_mixed_eagle3_catchup_${c}.json" > "$OUT/profile_mixed_eagle3_catchup_${c}.txt"
      grep "wall time per step" "$OUT/profile_mixed_eagle3_catchup_${c}.txt"
    done ;;
  linears)  # an eager matmul's host time when its row count is new each call (the head's
    # eager catch-up in a prompt step) against rows repeated and rows padded (~20 s)
    python3 tools/linear_host.py --json "$OUT/linear_host.json" ;;
  rows)  # few-row linears: the Triton kernels against cuBLAS in a layer chain, and the verify step with and without the rows kernel (~3 min)
    python3 tools/gemv_chain.py --repeats 5 --json "$OUT/gemv_chain.json"
    python3 tools/step_cost.py --model dummy:llama-3.1-8b --modes off,golden --off gemv_rows --k 4 --batches 1,16 --kv-cache-gb 1 --json "$OUT/step_cost_gemv_rows_llama8b.json" ;;
  host)  # where a 135M step's time goes (host phases; wall vs device, kernels): off, golden, EAGLE-3
    for m in ${HOST_MODES:-off golden eagle3}; do
      case $m in
        off) C= ;;
        golden) C='{"method":"golden","num_speculative_tokens":5,"acceptance_rate":0.0,"verify_budget":"off"}' ;;
        eagle3) C='{"method":"eagle3","model":"specserve/heads/smollm2-135m-instruct","num_speculative_tokens":5,"verify_budget":"off"}' ;;
      esac
      $S bench host-profile --model dummy:smollm2-135m --batch-sizes 1,16 --dtype bfloat16 --overlap ${C:+--speculative-config "$C"} --json "$OUT/host_profile_${m}_smollm2.json"
      # off with its sampling eager after the forward graph (runner/graph_tail.py off)
      [ $m = off ] && SPECSERVE_GRAPH_TAIL=0 $S bench host-profile --model dummy:smollm2-135m --batch-sizes 1,16 --dtype bfloat16 --overlap --json "$OUT/host_profile_off_eager_sampler_smollm2.json"
      # wall against device time per step, and the kernels (graphs as served)
      python3 tools/profile_step.py --model dummy:smollm2-135m --batch 1 --graphs --dtype bfloat16 --top 25 ${C:+--speculative-config "$C"} --json "$OUT/profile_b1_${m}_smollm2.json"
    done ;;
  anchor)  # batch-1 decode against gpt-fast's compiled decoder, paired (needs make devcarry GPT_FAST=CLONE)
    python3 tools/gpt_fast_ab.py --gpt-fast .devcarry/gpt-fast --off gemv_whole_k --off gemv_epilogues --json "$OUT/gpt_fast_ab.json" ;;
  structured)  # grammar-mask cost at 64 requests, and where the JSON step's host time goes
    $S bench structured --model dummy:llama-3.1-8b --concurrency 64 --repeats 9 --dtype bfloat16 --kv-cache-gb 8 --json "$OUT/structured_llama8b.json"
    python3 tools/structured_host_split.py --model dummy:llama-3.1-8b --dtype bfloat16 --repeats 2 --json "$OUT/structured_host_split_llama8b.json" ;;
  *) echo "unknown part: $1 (tests | decode | sweep05 | sweep08 | sweep10 | curve | idle | profile | gguf1..3 | train-head | train-data | train-head-resume | eagle | trace | split | mixed | steps | modes | catchup | linears | rows | host | anchor | structured)" >&2; exit 2 ;;
esac
