"""What structured outputs cost per step: the host time spent filling grammar bitmasks, and the
step time of JSON-schema requests against the same requests unconstrained, paired within each
repeat (the two modes alternate on one engine, same prompts, same concurrency).

    specserve bench structured --model dummy:llama-3.1-8b --concurrency 64 --repeats 5

The figure of merit is mask seconds per step / the unconstrained step time (the issue's "mask
cost at batch 64 <= 5 % of a decode step"), and the paired ratio of step times, which also
counts what masking costs beyond the fill (the upload and the masked sampling).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from specserve.bench.common import command_line, engine_kwargs
from specserve.bench.report import hardware_info, software_info, timestamp

# A few schemas of the kinds agents send: nested objects, arrays, enums, bounded numbers,
# patterns. Requests cycle through them.
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "days": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "weekday": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                        "high_c": {"type": "number", "minimum": -60, "maximum": 60},
                    },
                    "required": ["weekday", "high_c"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 5,
            },
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tool": {"enum": ["search", "calculator", "calendar"]},
            "arguments": {
                "type": "object",
                "properties": {"query": {"type": "string", "maxLength": 60}},
                "required": ["query"],
                "additionalProperties": False,
            },
        },
        "required": ["tool", "arguments"],
        "additionalProperties": False,
    },
]
PROMPT = "Reply with one JSON object that fits the schema. Request {i}: describe item {i}."


def _requests(llm, n: int, max_tokens: int, constrained: bool) -> list[tuple[list[int], Any]]:
    from specserve import SamplingParams
    from specserve.chat import user_prompt_ids
    from specserve.structured import StructuredOutputsParams

    out = []
    for i in range(n):
        so = StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]) if constrained else None
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so)
        out.append((user_prompt_ids(llm.tokenizer, PROMPT.format(i=i)), sp))
    return out


def run_structured_bench(args: argparse.Namespace) -> dict[str, Any]:
    from specserve import LLM
    from specserve.bench.spec_sweep import _closed_loop

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.concurrency,
        speculative_config=args.speculative_config,
        progress=False,
        seed=args.seed,
        **engine_kwargs(args.max_model_len, args.kv_cache_gb, False),
    )
    n = args.requests or 2 * args.concurrency
    reqs = {m: _requests(llm, n, args.max_tokens, m == "json") for m in ("plain", "json")}
    _closed_loop(llm, reqs["json"][: args.concurrency], args.concurrency)  # warm-up, compile
    _closed_loop(llm, reqs["plain"][: args.concurrency], args.concurrency)
    stats = llm.engine.grammars.stats
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "json": []}
    for r in range(args.repeats):
        for mode in ("plain", "json") if r % 2 == 0 else ("json", "plain"):
            s0, rows0, sec0 = stats.steps, stats.rows, stats.seconds
            deferred0 = llm.engine.num_deferred_steps
            res = _closed_loop(llm, reqs[mode], args.concurrency)
            runs[mode].append(
                {
                    "tokens": res.tokens,
                    "steps": res.steps,
                    "seconds": res.seconds,
                    "step_ms": 1e3 * res.seconds / max(res.steps, 1),
                    "tok_s": res.tokens / res.seconds,
                    "mask_steps": stats.steps - s0,
                    "mask_rows": stats.rows - rows0,
                    "mask_ms_per_step": 1e3 * (stats.seconds - sec0) / max(res.steps, 1),
                    # overlap: steps whose sampling waited for the ledger of the one in flight
                    "deferred_steps": llm.engine.num_deferred_steps - deferred0,
                }
            )
    step_ratio = [j["step_ms"] / p["step_ms"] for j, p in zip(runs["json"], runs["plain"])]
    mask_share = [j["mask_ms_per_step"] / p["step_ms"] for j, p in zip(runs["json"], runs["plain"])]
    rows = [j["mask_rows"] / max(j["mask_steps"], 1) for j in runs["json"]]
    report = {
        "benchmark": "structured",
        "command": command_line(),
        "timestamp": timestamp(),
        "hardware": hardware_info(),
        "software": software_info(),
        "model": llm.model_name,
        "concurrency": args.concurrency,
        "requests": n,
        "max_tokens": args.max_tokens,
        "speculative_config": args.speculative_config,
        "runs": runs,
        "median_mask_share_of_plain_step": statistics.median(mask_share),
        "median_step_time_ratio_json_vs_plain": statistics.median(step_ratio),
        "median_mask_ms_per_step": statistics.median(j["mask_ms_per_step"] for j in runs["json"]),
        "median_plain_step_ms": statistics.median(p["step_ms"] for p in runs["plain"]),
        # what a grammar adds to a step, paired within each repeat
        "median_json_extra_step_ms": statistics.median(
            j["step_ms"] - p["step_ms"] for j, p in zip(runs["json"], runs["plain"])
        ),
        "mask_rows_per_step": statistics.median(rows),
    }
    print(
        f"{llm.model_name}, C={args.concurrency}: grammar mask {report['median_mask_ms_per_step']:.3f}"
        f" ms/step = {100 * report['median_mask_share_of_plain_step']:.1f} % of a plain step "
        f"({report['median_plain_step_ms']:.3f} ms; {report['mask_rows_per_step']:.0f} rows); "
        f"JSON step / plain step (paired median) {report['median_step_time_ratio_json_vs_plain']:.3f}"
    )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return report


def add_structured_parser(sub: Any) -> None:
    p = sub.add_parser(
        "structured",
        help="grammar-mask cost per step: JSON-schema requests vs the same unconstrained",
    )
    p.add_argument("--model", default=None, help="model (default: the default model)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight (64)")
    p.add_argument("--requests", type=int, default=None, help="per mode and repeat (2 x C)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens at most (128)")
    p.add_argument("--repeats", type=int, default=5, help="paired repeats (5)")
    p.add_argument("--speculative-config", default=None, help="JSON, as for serve")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 (half)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--max-model-len", type=int, default=1024, help="context length (1024)")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache size (engine's)")
    p.add_argument("--seed", type=int, default=0, help="engine seed (0)")
    p.add_argument("--json", dest="json_path", default=None, help="write the report here")
