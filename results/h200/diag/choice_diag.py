"""Device diagnostic (session 10, for the next session): why auto speculated at R = 0.5, C = 64
in gpu_run48 (0.880 of plain) although the level's final curves price speculation ~5 % below
plain decoding. Runs the sweep's levels for the auto engine alone (the sweep's requests, warm-up
and closed loop) and logs every decision: requests, draft rows kept, expected tokens, the
speculative and plain prices, the sync overhead and the period biases; and every synchronous
period against the price it had. Writes $OUT/choice_diag.json (or ./choice_diag.json).

    DIAG_R=0.5 DIAG_LEVELS=16,64 DIAG_REPEATS=3 python3 results/h200/diag/choice_diag.py
CPU smoke run (no plain curve there, so no decisions are logged): DIAG_MODEL=dummy:tiny
DIAG_EXTRA="--dtype float32 --device cpu" DIAG_LEVELS=4 DIAG_REPEATS=1
"""

import json
import os
import statistics

from specserve.bench import spec_sweep as sw
from specserve.cli.main import build_parser

model = os.environ.get("DIAG_MODEL", "dummy:llama-3.1-8b")
levels = [int(x) for x in os.environ.get("DIAG_LEVELS", "16,64").split(",")]
argv = ["bench", "spec-sweep", "--model", model, "--method", "golden", "--k", "4",
        "--dataset", "random", "--input-len", "128", "--max-tokens", "128",
        "--concurrency", ",".join(map(str, levels)), "--requests-per-slot", "2",
        "--min-requests", "8", "--acceptance-rate", os.environ.get("DIAG_R", "0.5"),
        "--max-model-len", "1024"] + os.environ.get("DIAG_EXTRA", "--dtype bfloat16 --kv-cache-gb 12").split()  # fmt: skip
args = build_parser().parse_args(argv)
repeats = int(os.environ.get("DIAG_REPEATS", "3"))
llm = sw._engine(args, "auto", max(levels))
eng = llm.engine
pol = eng.budget
decisions, periods = [], []
real_choose, real_period = pol._choose, pol.record_sync_period


def choose(usable, num_ready, kv, count=True):
    choice = real_choose(usable, num_ready, kv, count)
    if count and pol.plain is not None:
        plain_t = pol.plain.at(num_ready, kv, num_ready)
        decisions.append({
            "n": num_ready, "kept": sum(choice.num_verify), "offered": sum(map(len, usable)),
            "expected": choice.expected_tokens, "spec_t": choice.step_time, "plain_t": plain_t,
            "sync_oh": pol.sync_overhead, "sync_bias": pol.sync_bias.factor,
            "plain_bias": pol.plain_bias.factor, "plain_observed": pol.plain.observed(num_ready),
        })  # fmt: skip
    return choice


def period(rows, seconds, kv, requests):
    predicted = pol.curve.at(rows, kv, requests) + pol.sync_overhead
    periods.append({"rows": rows, "actual": seconds, "predicted": predicted,
                    "observed": pol.curve.observed(rows)})  # fmt: skip
    real_period(rows, seconds, kv, requests)


trims = []
real_trim = pol.trim


def trim(ready, drafts, confs):
    keep = real_trim(ready, drafts, confs)
    trims.append({"n": len(ready), "offered": sum(map(len, drafts)), "kept": sum(keep),
                  "step": eng.scheduler.step_id + 1})  # fmt: skip
    return keep


pol._choose, pol.record_sync_period, pol.trim = choose, period, trim
report = {}
for c in levels:
    requests = sw._requests_for(args, llm, c, {})
    sw._warm_up(llm, requests, c)
    decisions.clear()
    periods.clear()
    trims.clear()
    runs = [sw._closed_loop(llm, requests, c) for _ in range(repeats)]
    spec = [d for d in decisions if d["kept"]]
    full = [d for d in decisions if d["n"] == c]
    report[c] = {
        "tok_s": [r.tokens / r.seconds for r in runs],
        "steps": [r.steps for r in runs],
        "decisions": len(decisions),
        "speculated": len(spec),
        "at_full_load": len(full),
        "plain_observed_at_full_load": sum(d["plain_observed"] for d in full),
        "median_spec_over_plain_rate": statistics.median(
            (d["expected"] / d["spec_t"]) / (d["n"] / d["plain_t"]) for d in decisions
        ) if decisions else None,  # fmt: skip
        "mean_actual_over_predicted_period": statistics.fmean(
            p["actual"] / p["predicted"] for p in periods
        ) if periods else None,  # fmt: skip
        "median_actual_over_predicted_period": statistics.median(
            p["actual"] / p["predicted"] for p in periods
        ) if periods else None,  # fmt: skip
        "trims": len(trims),
        "trims_keeping_nothing": sum(not t["kept"] for t in trims),
        "trims_keeping_nothing_with_drafts": sum(not t["kept"] and t["offered"] > 0 for t in trims),
        "trim_log": trims,
        "first_decisions": decisions[:40],
        "last_decisions": decisions[-40:],
        "periods_sample": periods[:: max(1, len(periods) // 80)],
        "budget": sw._budget_state(llm),
    }
    r = report[c]
    print(f"C={c}: tok/s {[round(x) for x in r['tok_s']]}, decisions {r['decisions']}, "
          f"speculated {r['speculated']}, trims {r['trims']} (kept nothing with drafts "
          f"{r['trims_keeping_nothing_with_drafts']}), plain observed at full load "
          f"{r['plain_observed_at_full_load']}/{r['at_full_load']}, spec/plain rate (median) "
          f"{r['median_spec_over_plain_rate']}, period actual/predicted mean "
          f"{r['mean_actual_over_predicted_period']} median {r['median_actual_over_predicted_period']}",
          flush=True)  # fmt: skip
out = os.path.join(os.environ.get("OUT", "."), "choice_diag.json")
with open(out, "w") as f:
    json.dump(report, f, indent=1, default=str)
