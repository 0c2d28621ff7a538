"""Where a grammar-constrained step's host time goes: JSON-schema requests against the same
requests unconstrained, host milliseconds per step in each part of the grammar path.

    PYTHONPATH=. python tools/structured_host_split.py --model dummy:llama-3.1-8b \\
        --dtype bfloat16 --repeats 3

Parts (each timed on the engine's thread, wall time, nested ones included in their parent):
ledger_advance (every emitted token through its matcher), grammar_bitmask (the rows filled),
plan_logits (the logits-processing plan, grammar_bitmask and its upload included),
finish_deferred (a deferred step's sampling planned and queued: the critical path between a
readback and the sampling under overlap), apply (the mask on the logits: on CUDA the launches
only; on a CPU in the worker thread under overlap, so not on the engine's thread). A profile of
the code, not of the device: the timers wrap functions in place.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

TIMES: dict[str, float] = defaultdict(float)


def _timed(owner: Any, name: str, key: str) -> None:
    inner: Callable = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            TIMES[key] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="dummy:smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--overlap", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import specserve.runner.logits_plan as logits_plan
    import specserve.runner.step_sampler as step_sampler
    import specserve.step_launch as launch
    from specserve import LLM
    from specserve.bench.spec_sweep import _closed_loop
    from specserve.bench.structured import _requests
    from specserve.structured.matcher import RequestGrammar

    _timed(RequestGrammar, "advance", "ledger_advance")
    _timed(logits_plan, "grammar_bitmask", "grammar_bitmask")
    _timed(step_sampler, "plan_logits_processing", "plan_logits")
    _timed(step_sampler, "apply_logits_processing", "apply")
    _timed(launch.Launcher, "finish", "finish_deferred")
    overlap = {"auto": None, "on": True, "off": False}[args.overlap]
    c = args.concurrency
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=c,
        max_model_len=1024,
        overlap=overlap,
        progress=False,
    )
    reqs = {m: _requests(llm, 2 * c, args.max_tokens, m == "json") for m in ("plain", "json")}
    _closed_loop(llm, reqs["json"][:c], c)  # warm-up: grammars compiled, kernels built
    _closed_loop(llm, reqs["plain"][:c], c)
    runs: dict[str, list[float]] = defaultdict(list)
    for rep in range(args.repeats):
        for mode in ("plain", "json") if rep % 2 == 0 else ("json", "plain"):
            TIMES.clear()
            res = _closed_loop(llm, reqs[mode], c)
            runs[f"{mode}.step_ms"].append(1e3 * res.seconds / res.steps)
            for key, sec in TIMES.items():
                runs[f"{mode}.{key}_ms"].append(1e3 * sec / res.steps)
    out: dict[str, Any] = {k: statistics.median(v) for k, v in sorted(runs.items())}
    pairs = zip(runs["json.step_ms"], runs["plain.step_ms"])
    out["json_extra_step_ms"] = statistics.median(j - q for j, q in pairs)
    out["model"], out["concurrency"], out["overlap"] = llm.model_name, c, llm.engine.overlap
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"runs": runs, "medians": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
