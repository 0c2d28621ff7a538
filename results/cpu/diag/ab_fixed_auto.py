"""Fixed k against auto alone, alternating order each repeat (fixed, auto / auto, fixed), same
engines and requests (the spec-sweep's n-gram HumanEval setup): is a sweep miss where both make
the same decisions systematic, or the VM's noise? Session 11: C = 4, 10 repeats, medians 88.4 vs
88.3 tok/s (0.999), paired ratios 0.905-1.13. Session 13, 14 repeats: C = 4 88.8 vs 89.2 (1.004),
C = 16 152.3 vs 157.2 (1.032).

    python results/cpu/diag/ab_fixed_auto.py 4 10
"""

import statistics
import sys

from specserve.bench import spec_sweep as sw
from specserve.cli.main import build_parser

concurrency, repeats = int(sys.argv[1]), int(sys.argv[2])
args = build_parser().parse_args(
    ["bench", "spec-sweep", "--method", "ngram", "--k", "4", "--dataset", "humaneval",
     "--concurrency", str(concurrency), "--requests-per-slot", "1", "--min-requests", "8",
     "--max-tokens", "96", "--dtype", "float32", "--device", "cpu"]
)  # fmt: skip
llms = {mode: sw._engine(args, mode, concurrency) for mode in ("fixed", "auto")}
requests = sw._requests_for(args, llms["fixed"], concurrency, {})
for llm in llms.values():
    sw._warm_up(llm, requests, concurrency)
tok_s: dict[str, list[float]] = {mode: [] for mode in llms}
for r in range(repeats):
    order = ["fixed", "auto"] if r % 2 == 0 else ["auto", "fixed"]
    for mode in order:
        out = sw._closed_loop(llms[mode], requests, concurrency)
        tok_s[mode].append(out.tokens / out.seconds)
    print(r, order, {m: round(v[-1], 1) for m, v in tok_s.items()}, flush=True)
fixed, auto = statistics.median(tok_s["fixed"]), statistics.median(tok_s["auto"])
paired = sorted(round(a / f, 3) for a, f in zip(tok_s["auto"], tok_s["fixed"]))
print(f"median fixed {fixed:.1f} auto {auto:.1f} ratio {auto / fixed:.3f}; paired {paired}")
