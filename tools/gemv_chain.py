"""A chain of decoder linears (qkv, o_proj, gate_up with silu-and-mul, down_proj) replayed in a
CUDA graph at 1, 2, 5, 8 and 16 rows: microseconds a layer with Triton (specserve.ops.gemv: the
one-row GEMV, the rows kernel past one row) against cuBLAS and the separate silu-and-mul, for
the Llama-3.1-8B and SmolLM2-135M shapes. Random bf16 weights; 7 repeats, the sides
alternating, the ratio paired within each.

    python tools/gemv_chain.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# hidden, intermediate, qkv rows, layers in the chain
SHAPES = {"llama-3.1-8b": (4096, 14336, 6144, 8), "smollm2-135m": (576, 1536, 960, 30)}


def _chain(layers: list[tuple[torch.Tensor, ...]], hidden: int):
    from specserve.ops import fused, gemv

    def run(x: torch.Tensor) -> torch.Tensor:  # [rows, hidden]
        for wq, wo, wgu, wd in layers:
            a = gemv.linear(gemv.linear(x, wq, None)[:, :hidden].contiguous(), wo, None)
            if gemv.glu_eligible(a, wgu):
                a = gemv.gemv_glu(a, wgu)
            else:
                a = fused.silu_and_mul(gemv.linear(a, wgu, None))
            x = gemv.linear(a, wd, None)
        return x

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args()
    from specserve import env
    from specserve.bench.report import median_interval

    dev = torch.device("cuda")
    report: dict = {"device": torch.cuda.get_device_name(), "us_per_layer": {}}
    for name, (h, inter, qkv, n_layers) in SHAPES.items():
        gen = torch.Generator().manual_seed(0)
        shapes = ((qkv, h), (h, h), (2 * inter, h), (h, inter))
        layers = [tuple((torch.randn(n, k, generator=gen) / k**0.5).to(dev, torch.bfloat16)
                        for n, k in shapes) for _ in range(n_layers)]  # fmt: skip
        chain = _chain(layers, h)
        for rows in (1, 2, 5, 8, 16):
            graphs = {}
            for side, on in (("gemv", True), ("cublas", False)):
                with env.override(gemv=on):
                    x = torch.randn(rows, h, device=dev, dtype=torch.bfloat16)
                    chain(x)  # compile outside the capture
                    torch.cuda.synchronize()
                    graphs[side] = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graphs[side]):
                        chain(x)
            us: dict[str, list[float]] = {s: [] for s in graphs}
            for r in range(args.repeats):
                for side in ("gemv", "cublas") if r % 2 else ("cublas", "gemv"):
                    graphs[side].replay()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(20):
                        graphs[side].replay()
                    torch.cuda.synchronize()
                    us[side].append(1e6 * (time.perf_counter() - t0) / 20 / n_layers)
            ratio = median_interval([a / b for a, b in zip(us["gemv"], us["cublas"])])
            med = {s: statistics.median(v) for s, v in us.items()}
            report["us_per_layer"][f"{name} rows={rows}"] = {"runs": us, "median": med,
                                                             "gemv/cublas": ratio}  # fmt: skip
            print(f"{name} rows={rows}: gemv {med['gemv']:.1f} us, cublas {med['cublas']:.1f} us,"
                  f" ratio {ratio[0]:.3f} [{ratio[1]:.3f}, {ratio[2]:.3f}]", flush=True)  # fmt: skip
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
