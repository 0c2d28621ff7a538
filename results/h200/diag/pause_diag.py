"""Device diagnostic (session 7): why auto runs 3-4 % below plain at R = 0.5, C = 64 although it
pauses speculation. Runs the spec-sweep point (same requests, warm-up and closed loop) for off and
auto, and logs every step of the timed runs: launched overlapped or synchronously, rows, draft
rows, and the host time from one launch to the next. Prints per mode: steps, sync steps (with
their step ids and rows), draft rows, and the time in steps that follow a sync step."""

import json
import os
import statistics
import time

from specserve.bench import spec_sweep as sw
from specserve.cli.main import build_parser

model = os.environ.get("DIAG_MODEL", "dummy:llama-3.1-8b")
c = int(os.environ.get("DIAG_C", "64"))
argv = ["bench", "spec-sweep", "--model", model, "--method", "golden", "--k", "4",
        "--dataset", "random", "--input-len", "128", "--max-tokens", "128",
        "--concurrency", str(c), "--requests-per-slot", "2", "--min-requests", "8",
        "--acceptance-rate", os.environ.get("DIAG_R", "0.5"),
        "--max-model-len", "1024"] + os.environ.get("DIAG_EXTRA", "--dtype bfloat16 --kv-cache-gb 12").split()
args = build_parser().parse_args(argv)
repeats = int(os.environ.get("DIAG_REPEATS", "3"))
report = {}
for mode in ("off", "auto"):
    llm = sw._engine(args, mode, c)
    eng = llm.engine
    requests = sw._requests_for(args, llm, c, {})
    sw._warm_up(llm, requests, c)
    runs = []
    for _ in range(repeats):
        log = []
        orig = eng._launch

        def launch(batch, overlap, orig=orig, log=log):
            log.append((batch.step, overlap, batch.num_rows, sum(batch.num_drafts), time.perf_counter()))
            return orig(batch, overlap)

        eng._launch = launch
        res = sw._closed_loop(llm, requests, c)
        eng._launch = orig
        gaps = [b[4] - a[4] for a, b in zip(log, log[1:])]
        sync = [(s, r, d) for s, o, r, d, _ in log if not o]
        # the launch-to-launch gap of a step is its period; a sync step's is what it costs
        after_sync = [g for (s, o, *_), g in zip(log, gaps) if not o]
        runs.append({
            "seconds": round(res.seconds, 4), "tok_s": round(res.tokens / res.seconds, 1),
            "steps": len(log), "sync_steps": len(sync), "draft_rows": sum(l[3] for l in log),
            "sync": sync, "median_gap_ms": round(statistics.median(gaps) * 1e3, 3),
            "sync_gap_ms": [round(g * 1e3, 2) for g in after_sync],
            "slow_gaps": [(log[i][0], log[i][1], log[i][2], round(g * 1e3, 2))
                          for i, g in enumerate(gaps) if g > 3 * statistics.median(gaps)],
        })
    report[mode] = runs
    m = llm.get_metrics()
    report[mode + "_budget"] = {k: v for k, v in m.items() if k.startswith("verify_budget") or k.startswith("spec_")}
    for r in runs:
        print(mode, {k: r[k] for k in ("seconds", "tok_s", "steps", "sync_steps", "draft_rows", "median_gap_ms")})
        print("   sync steps (step, rows, drafts):", r["sync"][:40])
        print("   their gaps ms:", r["sync_gap_ms"][:40])
        print("   slow gaps (step, overlapped, rows, ms):", r["slow_gaps"][:30])
    del llm, eng
    sw.free_memory()
out = os.environ.get("OUT")
if out:
    with open(os.path.join(out, "pause_diag.json"), "w") as f:
        json.dump(report, f, indent=1)
