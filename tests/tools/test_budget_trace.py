"""The budget trace runs a sweep on CPU and reports the periods the budget priced."""

import json

from tools import budget_trace


def test_the_trace_reports_each_budget_engine_s_steps(tmp_path) -> None:
    path = tmp_path / "trace.json"
    sweep = (
        "bench spec-sweep --model dummy:tiny --method golden --acceptance-rate 0.5 --k 2 "
        "--dataset random --input-len 8 --max-tokens 12 --concurrency 2 --requests-per-slot 1 "
        "--min-requests 2 --repeats 1 --modes off,auto --dtype float32 --device cpu "
        "--max-model-len 64"
    )
    # its exit code is the sweep's: 1 where a check misses, as a 2-request sweep may
    budget_trace.main(["--json", str(path), "--raw", "--", *sweep.split()])
    report = json.loads(path.read_text())
    (engine,) = report["engines"]  # off has no budget: nothing to trace
    kinds = engine["by_kind"]
    assert any(k.startswith("plain") or k.startswith("verify") for k in kinds)
    assert all(s["n"] > 0 and s["median_ms"] > 0 for s in kinds.values())
    assert sum(s["n"] for s in kinds.values()) == len(engine["steps"])
    assert any(priced for _, priced, _ in engine["steps"])
