"""Device diagnostic (session 9): the decode tile config across batch sizes and contexts.

Session 8's sweep at 256 one-row requests (contexts 32-768, 8B heads) found 64 keys x 2 warps
3-10 % faster than the default 128 keys x 4 warps, which an earlier batch-64 x 4k sweep had
picked. This times a few configs (and the split count the heuristic picks) for batch 1, 16, 64
and 256 at short and long contexts, in CUDA graphs, with the split-KV merge inside the kernel.

    python3 results/h200/diag/attn_decode_tiles.py     # H200, JSON under $OUT"""

import json
import os
import random
import sys

import torch

sys.path.insert(0, os.getcwd())
from specserve.ops.triton_attention import (  # noqa: E402
    TileConfig,
    choose_num_splits,
    choose_tile_config,
    paged_attention_triton,
)
from tests.gpu.test_triton_attention import _graph_us, make_case  # noqa: E402

CONFIGS = [(128, 4, 2), (64, 2, 2), (64, 4, 2), (32, 2, 2), (64, 2, 3)]


def main() -> None:
    dev = torch.device("cuda")
    rng = random.Random(0)
    default = choose_tile_config(1, 4, 128)
    report = []
    for b in (1, 16, 64, 256):
        for lo, hi in ((300, 500), (3000, 4000)):
            if b * hi > 256 * 1024:  # keep the cache small
                continue
            c_lens = [rng.randint(lo, hi) for _ in range(b)]
            case = make_case(dev, torch.bfloat16, [1] * b, c_lens, poison=False)
            gb = sum(c_lens) * 8 * 128 * 2 * 2 / 1e9
            # as a graph would launch it: splits from the bound, not the real lengths
            splits = choose_num_splits(b * 8, 4096, dev)
            row = {"batch": b, "ctx": [lo, hi], "splits": splits, "gb": gb, "us": {}}
            for bn, warps, stages in CONFIGS:
                cfg = TileConfig(default.block_q, default.block_m, bn, warps, stages)

                def fn(cfg=cfg, case=case, s=splits):
                    return paged_attention_triton(
                        case.q, case.cache, case.ctx, case.scale, num_splits=s, config=cfg
                    )

                row["us"][f"{bn}x{warps}x{stages}"] = round(_graph_us(fn), 2)
            print(b, lo, hi, splits, row["us"], flush=True)
            report.append(row)
            del case
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "attn_decode_tiles.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
