"""What an eager matmul costs the host when its row count changes from call to call (CUDA).

A step with a prompt chunk runs the EAGLE-3 head's catch-up eagerly over a row count that is
new nearly every step (decode rows plus the new prompt's). If the BLAS library picks its kernel
anew for each shape, that choice is host time on every such step. This times the launch of
`torch.nn.functional.linear` (no sync inside the timing window) for the head's shapes, rows
repeated against rows never seen before, and against rows padded up to a multiple of --pad.

    python tools/linear_host.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

# (in, out) of the shipped head's linears on the 135M shape: fc, qkv, o, gate_up, down, lm_head
SHAPES = [(1728, 576), (1152, 960), (576, 576), (576, 3072), (1536, 576), (576, 8192)]


def _launch_us(w: torch.Tensor, rows: list[int], dtype: torch.dtype) -> float:
    """Median host microseconds of one linear launch over inputs of these row counts."""
    xs = [torch.randn(m, w.shape[1], device=w.device, dtype=dtype) for m in rows]
    torch.cuda.synchronize()
    out = []
    for x in xs:
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        out.append(time.perf_counter() - t0)
        torch.cuda.synchronize()  # the next launch starts from an idle queue, as a step's does
    return 1e6 * statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200, help="launches per case")
    p.add_argument("--base", type=int, default=400, help="the smallest row count")
    p.add_argument("--pad", type=int, default=64, help="padded case: rows rounded up to this")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    fresh = [args.base + i for i in range(args.calls)]  # each shape met once
    same = [args.base] * args.calls
    padded = [-(-m // args.pad) * args.pad for m in fresh]
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "us": {}}
    for k, n in SHAPES:
        w = torch.randn(n, k, device=dev, dtype=dtype)
        _launch_us(w, same[:5] + fresh[-5:], dtype)  # warm-up outside the measured shapes
        cases = {"same": same, "fresh": [m + args.calls for m in fresh], "padded": padded}
        us = {c: _launch_us(w, r, dtype) for c, r in cases.items()}
        report["us"][f"{k}x{n}"] = us
        print(f"{k:5d} x {n:5d}: " + "  ".join(f"{c} {v:7.1f} us" for c, v in us.items()))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
