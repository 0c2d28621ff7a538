"""Time the decoder's matmul shapes: cuBLAS (F.linear) against the few-row Triton GEMV and its
block configs, and the lm_head at the row counts decode steps use (CUDA).

    python -m specserve.bench.gemm_shapes --hidden 4096 --inter 14336 --q 4096 --kv 1024 \
        --vocab 128256 --json gemm.json

Prints, per weight shape and row count, microseconds per call and the weight-streaming
bandwidth; the GEMV rows list every config tried, best first. Used to pick
specserve.ops.linear's block sizes and to see where cuBLAS is far from the roofline.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def _time_us(fn: Callable[[int], Any], reps: int = 50) -> float:
    """Median over 5 batches of `reps` back-to-back calls fn(0), fn(1), ... (fn picks a weight
    copy by the index, so a weight never sits in L2 from the previous call)."""
    for j in range(5):
        fn(j)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for j in range(reps):
            fn(j)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


L2_FLUSH = 256 * 2**20  # bytes of weight copies cycled through per shape


def _launch(kern, x, ws, m, n, k, gated, bn, bk, warps, stages, j) -> None:  # noqa: ANN001
    w = ws[j % len(ws)]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    kern[(-(-n // bn),)](
        x, w, y, m, n, x.stride(0), w.stride(0), K=k, GATED=gated,
        BLOCK_M=1 << max(0, m - 1).bit_length(), BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    from specserve.ops import linear
    from specserve.ops.fused import silu_and_mul

    dev, dt = torch.device("cuda"), torch.bfloat16
    h, i = args.hidden, args.inter
    shapes = {
        "qkv": (args.q + 2 * args.kv, h),
        "o": (h, args.q),
        "gate_up": (2 * i, h),
        "down": (h, i),
    }
    kern = linear._kernels()._gemv_kernel
    out: dict[str, Any] = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name()}
    rows = []
    for name, (n, k) in shapes.items():
        # copies enough to overflow the 50 MB L2 of an H100/H200, used in turn
        ws = [
            torch.randn(n, k, device=dev, dtype=dt)
            for _ in range(max(2, -(-L2_FLUSH // (2 * n * k))))
        ]
        gated = name == "down"
        for m in args.rows:
            x = torch.randn(m, 2 * k if gated else k, device=dev, dtype=dt)
            if gated:
                cublas = _time_us(lambda j: F.linear(silu_and_mul(x), ws[j % len(ws)]))  # noqa: B023
            else:
                cublas = _time_us(lambda j: F.linear(x, ws[j % len(ws)]))  # noqa: B023
            trials = []
            configs = itertools.product((8, 16, 32), (256, 512), (4, 8), (2, 4)) if m == 1 else []
            for cfg in configs:  # a sweep at one row: each config is a compile per shape
                if k % cfg[1]:
                    continue
                go = functools.partial(_launch, kern, x, ws, m, n, k, gated, *cfg)
                try:
                    trials.append((_time_us(go, reps=20), *cfg))
                except Exception as e:  # a config can exceed shared memory / registers
                    print(f"  skip {name} {cfg}: {type(e).__name__}")
            trials.sort()
            best = trials[0] if trials else (float("nan"),)
            fn = linear.gated_linear if gated else linear.linear
            default = _time_us(lambda j: fn(x, ws[j % len(ws)]))  # noqa: B023
            gb = n * k * 2 / 1e9
            row = {
                "shape": name, "n": n, "k": k, "rows": m, "cublas_us": cublas,
                "gemv_default_us": default, "gemv_best": best, "gemv_top5": trials[:5],
                "cublas_tb_s": gb / cublas * 1e3, "default_tb_s": gb / default * 1e3,
            }  # fmt: skip
            rows.append(row)
            print(
                f"{name:8s} [{n}x{k}] m={m}: cuBLAS {cublas:7.1f} us ({row['cublas_tb_s']:.2f} TB/s)"
                f"  gemv default {default:7.1f} us ({row['default_tb_s']:.2f} TB/s)"
                f"  best {best[0]:7.1f} us cfg {best[1:]}",
                flush=True,
            )
    out["layers"] = rows
    head = []
    w = torch.randn(args.vocab, h, device=dev, dtype=dt) * h**-0.5
    for m in args.head_rows:
        x = torch.randn(m, h, device=dev, dtype=dt)
        t = _time_us(lambda j: F.linear(x, w).float(), reps=10)  # noqa: B023
        t_mm = _time_us(lambda j: torch.mm(w, x.t()).t().float(), reps=10)  # noqa: B023
        flop = 2 * m * h * args.vocab
        head.append({"rows": m, "f_linear_us": t, "w_x_t_us": t_mm, "tflops": flop / t / 1e6})
        print(
            f"lm_head m={m:5d}: F.linear {t:8.1f} us ({flop / t / 1e6:6.1f} TFLOP/s), "
            f"W @ x^T {t_mm:8.1f} us",
            flush=True,
        )
    out["lm_head"] = head
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--q", type=int, default=4096)
    p.add_argument("--kv", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument(
        "--head-rows",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 64, 128, 256, 512, 1024, 1280],
    )
    p.add_argument("--json", dest="json_path", default=None)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
