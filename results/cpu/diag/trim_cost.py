"""Host time of one verify-budget decision (VerifyBudgetPolicy.trim) at n requests x 4 drafts of
confidence 0.8, over synthetic H200-like curves (a plain curve too, so the speculation-vs-plain
verdict runs as on CUDA). Session 12 on the CPU VM: 10-22 us at n = 1, 50-70 us at n = 16.

    python results/cpu/diag/trim_cost.py 16 [profile]
"""

import cProfile
import pstats
import sys
import time
from types import SimpleNamespace

from specserve.runner.cuda_graph import capture_sizes
from specserve.spec.budget_policy import VerifyBudgetPolicy
from specserve.spec.step_cost import ENGINE_REFRESH_EVERY, StepCostCurve

n, k = int(sys.argv[1]), 4
buckets = capture_sizes(256 * (1 + k))
curve = StepCostCurve(buckets, padded=True, kv_cost=2.2e-8, req_cost=5e-7)
curve.calibrate(lambda r: 5e-3 + r * 1.5e-5, reps=2)
plain = StepCostCurve(buckets[:34], padded=True, kv_cost=2.2e-8, req_cost=5e-7)
plain.calibrate(lambda r: 4.5e-3 + r * 1e-5, reps=1)
for c in (curve, plain):
    c.refresh_every = ENGINE_REFRESH_EVERY
for rows in range(n, n * (1 + k) + 1):  # real steps at every total the chooser may pick
    for _ in range(3):
        curve.record(rows, 5e-3 + rows * 1.5e-5, 0, n)
for _ in range(3):
    plain.record(n, 4.5e-3 + n * 1e-5, 0, n)
sched = SimpleNamespace(running=[], waiting=[], max_num_seqs=256, step_id=0)
policy = VerifyBudgetPolicy.from_curves(SimpleNamespace(scheduler=sched), 8192, curve, plain)
for _ in range(20):
    policy.record_sync_overhead(5e-4, n)
ready = [SimpleNamespace(token_ids=[0] * 200) for _ in range(n)]
drafts, confs = [[1] * k for _ in range(n)], [[0.8] * k for _ in range(n)]


def run(steps: int) -> None:
    for i in range(steps):
        sched.step_id = i
        policy.trim(ready, drafts, confs)
        if i % ENGINE_REFRESH_EVERY == 0:
            policy.prepare()  # as StepTimer.flush does, off the critical path


run(200)
t0 = time.perf_counter()
run(2000)
print(f"n = {n}: {(time.perf_counter() - t0) / 2000 * 1e6:.1f} us per decision (mean), "
      f"{policy.trim_time * 1e6:.1f} us (median of the last 32)")  # fmt: skip
if len(sys.argv) > 2:
    cProfile.run("run(2000)", "/tmp/trim_cost.prof")
    pstats.Stats("/tmp/trim_cost.prof").sort_stats("tottime").print_stats(12)
