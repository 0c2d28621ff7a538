"""Device diagnostic (session 8): decode attention of the 256-request run, config sweep.

The 256-request run's decode steps take ~11.2 ms, about a third of it in paged attention (256
requests, contexts 32-768, Llama-3.1-8B heads). This times `paged_attention_triton` on that
shape (256 one-row requests, contexts uniform in 32..768, block 16) for every tile config and
split count below, in a CUDA graph, and reports KV bytes read per second next to a device copy.

    python3 results/h200/diag/attn_b256.py     # H200, JSON under $OUT"""

import itertools
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.getcwd())
from specserve.ops.triton_attention import (  # noqa: E402
    TileConfig,
    choose_tile_config,
    paged_attention_triton,
)
from tests.gpu.test_triton_attention import _bench_us, _graph_us, make_case  # noqa: E402


def main() -> None:
    dev = torch.device("cuda")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() / (_bench_us(lambda: dst.copy_(src)) * 1e-6) / 1e12
    src = dst = None  # free the 2 GB before the cases
    rng = random.Random(0)
    report = {"copy_TBps": copy_bw, "cases": []}
    for lo, hi in ((32, 768), (400, 400)):
        c_lens = [rng.randint(lo, hi) for _ in range(256)]
        case = make_case(dev, torch.bfloat16, [1] * 256, c_lens, poison=False)
        gb = sum(c_lens) * 8 * 128 * 2 * 2 / 1e9
        default = choose_tile_config(1, 4, 128)
        rows = []
        for splits, bn, warps, stages in itertools.chain(
            itertools.product((1,), (32, 64, 128), (2, 4, 8), (2, 3, 4)),
            itertools.product((2, 4), (64, 128), (4,), (2, 3)),
        ):
            cfg = TileConfig(default.block_q, default.block_m, bn, warps, stages)

            def fn(s=splits, cfg=cfg, case=case):
                return paged_attention_triton(
                    case.q, case.cache, case.ctx, case.scale, num_splits=s, config=cfg
                )

            try:
                us = _graph_us(fn)
            except Exception as e:  # noqa: BLE001 - a config that does not compile
                rows.append({"cfg": [splits, bn, warps, stages], "error": str(e)[:200]})
                continue
            rows.append({"cfg": [splits, bn, warps, stages], "us": us, "TBps": gb / us * 1e3})
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        d = [
            r for r in ok if r["cfg"] == [1, default.block_n, default.num_warps, default.num_stages]
        ]
        print(
            f"ctx {lo}-{hi}: {gb:.2f} GB of KV; default {d[0]['us']:.1f} us {d[0]['TBps']:.2f} TB/s;"
            f" best {[(r['cfg'], round(r['us'], 1), round(r['TBps'], 2)) for r in ok[:4]]}",
            flush=True,
        )
        report["cases"].append({"ctx": [lo, hi], "gb": gb, "default": d[0], "rows": ok})
    print(f"copy {copy_bw:.2f} TB/s", flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "attn_b256.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
