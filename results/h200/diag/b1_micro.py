"""Device diagnostic (session 7): where batch-1 decode can still gain on the H200.

1. The five weight GEMMs of the 8B shape at one row: nn.Linear's x @ W^T (W [N, K], what the model
   runs) against x @ Wt with Wt [K, N] stored transposed (cuBLAS picks other kernels), each timed
   inside a CUDA graph that cycles 32 weight copies (one per layer, so nothing stays in L2), as
   GB/s of weight bytes.
2. Paged attention at batch 1 (context 256, graph bound 4096) with 1..32 key splits: the kernel
   plus the split combine, per layer, in a graph.
Prints one line per case and writes b1_micro.json under $OUT."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from graph_time import graph_time  # noqa: E402

dev = torch.device("cuda")
dt = torch.bfloat16
LAYERS = 32

out = {"gemm": [], "attention": []}
shapes = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
x_all = {k: torch.randn(1, K, device=dev, dtype=dt) for k, (N, K) in shapes.items()}
for name, (N, K) in shapes.items():
    w = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]
    x = x_all[name]
    y = torch.empty(1, N, device=dev, dtype=dt)
    t_lin = graph_time(lambda i, w=w: torch.matmul(x, w[i].t(), out=y))
    wt = [t.t().contiguous() for t in w]
    del w
    t_t = graph_time(lambda i, wt=wt: torch.matmul(x, wt[i], out=y))
    gb = N * K * 2 / 1e9
    row = {"name": name, "N": N, "K": K, "linear_us": t_lin * 1e6, "transposed_us": t_t * 1e6,
           "linear_TBps": gb / t_lin / 1e3, "transposed_TBps": gb / t_t / 1e3}
    out["gemm"].append(row)
    print(f"{name:8s} N={N:6d} K={K:6d}  x@W^T {t_lin*1e6:7.2f} us {gb/t_lin/1e3:5.2f} TB/s   "
          f"x@Wt {t_t*1e6:7.2f} us {gb/t_t/1e3:5.2f} TB/s", flush=True)
    del wt
    torch.cuda.empty_cache()

# copy bandwidth for reference
a = torch.empty(2 * 2**30 // 2, device=dev, dtype=dt)
b = torch.empty_like(a)
torch.cuda.synchronize()
e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
e0.record()
for _ in range(10):
    b.copy_(a)
e1.record()
torch.cuda.synchronize()
copy_tbps = 2 * a.numel() * 2 * 10 / (e0.elapsed_time(e1) / 1e3) / 1e12
out["copy_TBps"] = copy_tbps
print(f"copy {copy_tbps:.2f} TB/s", flush=True)
del a, b

from specserve.model.forward_context import ForwardContext, KVCache  # noqa: E402
from specserve.ops.triton_attention import paged_attention_triton  # noqa: E402

page, hkv, h, d = 16, 8, 32, 128
ctx_len, bound = int(os.environ.get("B1_CTX", "256")), 4096
blocks = bound // page
caches = [KVCache(torch.randn(blocks + 1, page, hkv, d, device=dev, dtype=dt),
                  torch.randn(blocks + 1, page, hkv, d, device=dev, dtype=dt)) for _ in range(4)]
i32 = torch.int32
n_pages = (ctx_len + page - 1) // page
table = torch.zeros(1, blocks, device=dev, dtype=i32)
table[0, :n_pages] = torch.arange(1, n_pages + 1, device=dev, dtype=i32)
ctx = ForwardContext(
    query_lens=torch.ones(1, device=dev, dtype=i32),
    cu_query_lens=torch.tensor([0, 1], device=dev, dtype=i32),
    context_lens=torch.tensor([ctx_len], device=dev, dtype=i32),
    block_tables=table,
    slot_mapping=torch.tensor([ctx_len - 1], device=dev, dtype=torch.int64),
    max_query_len=1,
    max_context_len=bound,
)
q = torch.randn(1, h, d, device=dev, dtype=dt)
ref = paged_attention_triton(q, caches[0], ctx, d**-0.5, num_splits=1).float()
for splits in (1, 2, 4, 8, 16, 32):
    got = paged_attention_triton(q, caches[0], ctx, d**-0.5, num_splits=splits).float()
    err = (got - ref).abs().max().item()
    t = graph_time(
        lambda i, s=splits: paged_attention_triton(q, caches[i % 4], ctx, d**-0.5, num_splits=s)
    )
    out["attention"].append({"splits": splits, "context": ctx_len, "us": t * 1e6, "max_err": err})
    print(f"attention b=1 ctx={ctx_len} bound={bound} splits={splits:2d}: {t*1e6:6.2f} us/layer "
          f"(max err vs 1 split {err:.1e})", flush=True)
o = os.environ.get("OUT")
if o:
    with open(os.path.join(o, "b1_micro.json"), "w") as f:
        json.dump(out, f, indent=1)
