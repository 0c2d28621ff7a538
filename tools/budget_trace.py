"""What the verify budget sees, step by step, around any `specserve` command (a sweep, usually).

    python tools/budget_trace.py --json trace.json -- bench spec-sweep --method eagle3 --k 5 \
        --concurrency 1 --modes off,auto --dataset humaneval --max-tokens 256

Each engine's steps: their kind (plain, drafting, verify, prompt), whether their period priced
the budget, and that period (readback to readback: what the budget sees). Summarised per kind,
plain steps also by their place after a step of another kind (a step's period holds the launch
of the one after it, so a switch's one-off host work lands on its neighbour). A model drafter's
plans: drafting or not, exploring, and the curve's price of the plan's rows over the run. --raw
keeps every step.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from typing import Any

from specserve import llm_engine
from specserve.speculative import verify_budget

STEPS: dict[int, list[tuple[str, bool, float]]] = defaultdict(list)  # engine -> (kind, priced, s)
# budget -> (draft, exploring, the curve's price of the plan's rows)
PLANS: dict[int, list[tuple[bool, bool, float]]] = defaultdict(list)


def _install() -> None:
    step_seconds, plan = llm_engine.LLMEngine._step_seconds, verify_budget.VerifyBudget.plan

    def traced_step_seconds(self, launched):  # the same period the engine prices
        last = self._last_readback
        seconds = step_seconds(self, launched)
        period = self._last_readback - (last if last is not None else launched.t0)
        STEPS[id(self)].append((launched.kind, seconds is not None, period))
        return seconds

    def traced_plan(self, surv, base_rows, *args, **kw):
        out = plan(self, surv, base_rows, *args, **kw)
        PLANS[id(self)].append((out.draft, self._exploring, self.curve(base_rows)))
        return out

    llm_engine.LLMEngine._step_seconds = traced_step_seconds
    verify_budget.VerifyBudget.plan = traced_plan


def _stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {
        "n": len(s),
        "median_ms": 1e3 * statistics.median(s),
        "p90_ms": 1e3 * s[len(s) * 9 // 10],
    }


def summary(steps: list[tuple[str, bool, float]]) -> dict[str, Any]:
    """Periods by (kind, priced), and plain steps' by their place after another kind (0: the
    first plain step after it, 5: the sixth and later)."""
    by_kind: dict[str, list[float]] = defaultdict(list)
    by_place: dict[int, list[float]] = defaultdict(list)
    place, prev = 0, None
    for kind, priced, period in steps:
        by_kind[f"{kind}{'' if priced else ' (not priced)'}"].append(period)
        if kind == "plain":
            place = place + 1 if prev == "plain" else 0
            by_place[min(place, 5)].append(period)
        prev = kind
    return {
        "by_kind": {k: _stats(v) for k, v in sorted(by_kind.items())},
        "plain_by_place": {p: _stats(v) for p, v in sorted(by_place.items())},
    }


def plans_summary(plans: list[tuple[bool, bool, float]]) -> dict[str, Any]:
    every = max(1, len(plans) // 40)
    return {
        "plans": len(plans),
        "drafting": sum(d for d, _, _ in plans),
        "exploring": sum(p for _, p, _ in plans),
        "price_ms_over_the_run": [round(1e3 * t, 3) for _, _, t in plans[::every]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", dest="json_path", required=True, help="write the trace here")
    p.add_argument("--raw", action="store_true", help="keep every step (kind, priced, period)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then a specserve command")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    _install()
    from specserve.cli.main import main as specserve_main

    rc = specserve_main(command)
    report: dict[str, Any] = {"command": command, "engines": [], "budgets": []}
    for steps in STEPS.values():
        report["engines"].append(summary(steps) | ({"steps": steps} if args.raw else {}))
    report["budgets"] = [plans_summary(plans) for plans in PLANS.values()]
    with open(args.json_path, "w") as f:
        json.dump(report, f, indent=1)
    for i, e in enumerate(report["engines"]):
        kinds = ", ".join(
            f"{k} {s['n']} x {s['median_ms']:.2f} ms" for k, s in e["by_kind"].items()
        )
        print(f"engine {i}: {kinds}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
