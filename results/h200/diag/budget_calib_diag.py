"""Device diagnostic (session 5): the auto engine's start-up step-cost samples against re-timed
synthetic steps and the real steps of one C = 1 / C = 4 golden run (R = 0.5)."""

import json
import os
import statistics
import sys

from specserve import LLM, SamplingParams
from specserve.bench.datasets import random_requests
from specserve.spec.calibration import StartupCalibration

out = {}
kw = dict(model=os.environ.get("DIAG_MODEL", "dummy:llama-3.1-8b"),
          dtype=os.environ.get("DIAG_DTYPE", "bfloat16"), max_num_seqs=256, progress=False, seed=0,
          max_model_len=1024, kv_cache_memory_gb=12)
# as in the interleaved sweep: the off and fixed engines exist when the auto one calibrates
others = [] if os.environ.get("DIAG_ALONE") else [
    LLM(**kw, speculative_config=None),
    LLM(**kw, speculative_config={"method": "golden", "num_speculative_tokens": 4,
                                   "verify_budget": "off", "acceptance_rate": 0.5}),
]
spec = {"method": "golden", "num_speculative_tokens": 4, "verify_budget": "auto",
        "acceptance_rate": 0.5}
llm = LLM(**kw, speculative_config=spec)
eng = llm.engine
pol = eng.budget
cal = StartupCalibration(eng)  # session 10: the synthetic steps moved to spec/calibration.py
c = pol.curve
out["kv_cost"], out["req_cost"] = c.kv_cost, c.req_cost
out["startup"] = {b: [round(x * 1e3, 3) for x in s] for b, s in zip(c.buckets, c._samples)}
print("kv", c.kv_cost, "req", c.req_cost)
print("startup ms", {b: v for b, v in list(out["startup"].items())[:12]})
retime = {}
for rows in (1, 2, 4, 8, 16, 24, 32, 64, 128, 256):
    dec = [cal._synthetic_step(rows) * 1e3 for _ in range(6)]
    ver = [cal._synthetic_step(rows, n_req=max(1, -(-rows // 5))) * 1e3 for _ in range(6)]
    retime[rows] = {"decode": [round(x, 3) for x in dec], "verify": [round(x, 3) for x in ver]}
    print(rows, "decode", round(statistics.median(dec), 3), dec[:3], "verify",
          round(statistics.median(ver), 3), ver[:3], flush=True)
out["retime"] = retime
import argparse  # noqa: E402

from specserve.bench.spec_sweep import _build_requests, _closed_loop  # noqa: E402

args = argparse.Namespace(dataset="random", input_len=128, max_tokens=128, seed=0, method="golden")
for C in (1, 4):
    reqs = _build_requests(args, llm, 8, C)
    r = _closed_loop(llm, reqs, C)
    print(f"C={C}", r.tokens / r.seconds, "tok/s", r.steps, "steps", flush=True)
    st = {
        "tok_s": r.tokens / r.seconds,
        "calib": {b: x and round(x * 1e3, 3) for b, x in zip(c.buckets, c._calib) if x},
        "real": {b: [round(y * 1e3, 3) for y in s] for b, s, o in zip(c.buckets, c._samples, c._observed) if o},
        "curve": [(b, round(x * 1e3, 3)) for b, x in c.points()[:12]],
    }
    if pol.plain is not None:
        p = pol.plain
        st["plain_calib"] = {b: x and round(x * 1e3, 3) for b, x in zip(p.buckets, p._calib) if x}
        st["plain_real"] = {b: [round(y * 1e3, 3) for y in s] for b, s, o in zip(p.buckets, p._samples, p._observed) if o}
        st["plain_curve"] = [(b, round(x * 1e3, 3)) for b, x in p.points()[:12]]
    out[f"C{C}"] = st
    print(json.dumps(st)[:3000], flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "budget_calib_diag.json"), "w"), indent=1)
