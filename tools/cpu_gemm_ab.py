"""The CPU's linear-layer GEMMs alone, paired: fp32 panels (ops/cpu_gemm) against integer blocks
(ops/cpu_qgemm) on vectors only and with AMX, over the default model's shapes.

    python tools/cpu_gemm_ab.py --rows 1,5,12,16,64 --repeats 5 --json out.json
    python tools/cpu_gemm_ab.py --rows 4,6,8,10,12,14 --amx-rows 1   # where AMX starts to pay

One pass is every linear of a decode step, each its own weight (30 layers of qkv, o, gate_up
and down, and the lm_head: 121 weights, streamed from DRAM as a step reads them) at `rows`
input rows. Random Q4_1-style blocks (the lm_head Q8_0-style); the fp32 panels hold the same
values. Each repeat times every variant once, in a rotated order; the report is the median ms
per pass and the median of per-repeat ratios to the panels with its 90 % bootstrap interval.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from specserve.bench.report import hardware_info, median_interval
from specserve.model.gguf_blocks import dequantized
from specserve.ops import cpu_gemm, cpu_qgemm

# SmolLM2-135M: (N, K, count) of qkv, o, gate_up, down and the lm_head
SHAPES = [(960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 576, 1)]


def _weights(seed: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, k, count in SHAPES:
        for _ in range(count):
            signed = n == 49152
            q = torch.randint(-127 if signed else 0, 128 if signed else 16, (n, k), generator=g)
            d = torch.rand(n, k // 32, generator=g) * 0.01
            m = torch.zeros_like(d) if signed else -torch.rand(n, k // 32, generator=g) * 0.08
            w = dequantized(q, d, m)
            out.append((n, k, cpu_gemm.to_panels(w), cpu_qgemm.pack((q, d, m))))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,5,12,16,64")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--amx-rows", type=int, default=cpu_qgemm.AMX_MIN_ROWS,
                   help="the amx variant's tail threshold (1: AMX for any tail)")  # fmt: skip
    args = p.parse_args(argv)
    panels_lib, lib = cpu_gemm.kernel(), cpu_qgemm.kernel()
    if panels_lib is None or lib is None:
        raise SystemExit("needs a C++ compiler and a CPU with AVX512-VNNI")
    amx = bool(lib.specserve_cpu_qgemm_amx_available())
    weights = _weights(0)

    def one_pass(variant: str, x: dict[int, torch.Tensor]) -> float:
        if variant != "panels":
            lib.specserve_cpu_qgemm_use_amx(args.amx_rows if variant == "amx" else 0)
        t = time.perf_counter()
        for n, k, panels, packed in weights:
            if variant == "panels":
                cpu_gemm.gemm(panels_lib, x[k], panels, None, n)
            else:
                cpu_qgemm.gemm(lib, x[k], packed, None, n)
        return (time.perf_counter() - t) * 1e3

    variants = ["panels", "blocks"] + (["amx"] if amx else [])
    report: dict[str, Any] = {"settings": vars(args), "hardware": hardware_info(), "rows": {}}
    for rows in (int(r) for r in args.rows.split(",")):
        x = {k: torch.randn(rows, k) for k in (576, 1536)}
        for v in variants:  # warm-up
            one_pass(v, x)
        ms: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(args.repeats):
            for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
                ms[v].append(one_pass(v, x))
        entry = {}
        for v in variants:
            med, lo, hi = median_interval([a / b for a, b in zip(ms["panels"], ms[v])])
            entry[v] = {"median_ms": sorted(ms[v])[len(ms[v]) // 2], "runs_ms": ms[v],
                        "speedup_vs_panels": med, "interval_90": [lo, hi]}  # fmt: skip
        report["rows"][rows] = entry
        print(f"{rows:3d} rows: " + ", ".join(
            f"{v} {e['median_ms']:.2f} ms ({e['speedup_vs_panels']:.2f}x "
            f"[{e['interval_90'][0]:.2f}, {e['interval_90'][1]:.2f}])" for v, e in entry.items()
        ), flush=True)  # fmt: skip
    lib.specserve_cpu_qgemm_use_amx(cpu_qgemm.AMX_MIN_ROWS)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
