import sys, collections, time, traceback
from specserve.speculative import step_cost
from specserve.cli.main import main
seen = collections.Counter()
orig = step_cost.StepCostCurve.observe
oinit = step_cost.StepCostCurve.__init__
def init(self, buckets, startup, padded):
    print("STARTUP", [(b, round(t * 1e3, 2)) for b, t in zip(buckets, startup)], flush=True)
    oinit(self, buckets, startup, padded)
def observe(self, rows, seconds):
    seen[rows] += 1
    if seconds > 0.05:
        print("SLOW", rows, round(seconds, 3), flush=True)
        traceback.print_stack(limit=6)
    return orig(self, rows, seconds)
step_cost.StepCostCurve.observe = observe
step_cost.StepCostCurve.__init__ = init
try:
    main(sys.argv[1:])
finally:
    print(sorted(seen.items()))
