"""Device diagnostic (session 7, prepared for session 8): a one-row split-K GEMV in Triton
against cuBLAS on the batch-1 GEMMs cuBLAS runs slowest (session 7, b1_micro: qkv 3.06 TB/s,
o_proj 2.54, down 3.61, against gate_up's 4.14 and a 4.00 TB/s copy).

The kernel: each program reduces BLOCK_N outputs over one of SPLIT_K slices of K. With
SPLIT_K > 1 the partial sums go to a workspace and the last program of each output block to
finish (an acq_rel counter) adds them and resets its counter: one launch, no zeroing, safe to
replay in a graph. Every config is checked against torch first, then timed in a CUDA graph over
32 weight copies (graph_time.py) next to cuBLAS on the same copies.

    python3 results/h200/diag/gemv_sweep.py                      # H200: sweep, JSON under $OUT
    TRITON_INTERPRET=1 python3 results/h200/diag/gemv_sweep.py   # CPU: correctness only"""

import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K]
    w_ptr,  # [N, K] row-major
    out_ptr,  # [N]
    part_ptr,  # [SPLIT_K, N] fp32 workspace
    count_ptr,  # [cdiv(N, BLOCK_N)] int32, zero between calls
    N: tl.constexpr,  # compile-time: one variant per weight shape, exact loop bounds
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_PER: tl.constexpr,  # K slice of one program, whole BLOCK_K tiles
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    k_lo = pid_k * K_PER
    acc = tl.zeros((BLOCK_N,), tl.float32)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * K
    for i in range(0, K_PER, BLOCK_K):
        rk = k_lo + i + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if SPLIT_K == 1:
        tl.store(out_ptr + rn, acc.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(part_ptr + pid_k * N + rn, acc, mask=n_ok)
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N,), tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part_ptr + s * N + rn, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + rn, total.to(out_ptr.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(count_ptr + pid_n, 0)


class Gemv:
    """out[N] = w[N, K] @ x[K] for one config; owns its workspace and counters."""

    def __init__(self, n, k, block_n, block_k, split_k, warps, stages, device):
        self.n, self.k = n, k
        self.cfg = (block_n, block_k, split_k, warps, stages)
        self.grid = (triton.cdiv(n, block_n), split_k)
        self.k_per = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
        self.part = torch.empty(split_k, n, device=device, dtype=torch.float32)
        self.count = torch.zeros(self.grid[0], device=device, dtype=torch.int32)

    def __call__(self, x, w, out):
        bn, bk, sk, warps, stages = self.cfg
        _gemv_kernel[self.grid](
            x, w, out, self.part, self.count, N=self.n, K=self.k,
            BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, K_PER=self.k_per,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip


def check(device, dtype, shapes, configs) -> None:
    for (n, k), cfg in itertools.product(shapes, configs):
        g = Gemv(n, k, *cfg, device=device)
        w = torch.randn(n, k, device=device, dtype=dtype) * 0.05
        x = torch.randn(k, device=device, dtype=dtype)
        want = (w.float() @ x.float()).to(dtype)
        for _ in range(2):  # twice: the counters must be back at zero
            out = torch.empty(n, device=device, dtype=dtype)
            g(x, w, out)
            err = (out.float() - want.float()).abs().max().item()
            tol = 2e-2 * max(1.0, want.float().abs().max().item())
            assert err <= tol, (n, k, cfg, err)
        assert int(g.count.sum()) == 0, (n, k, cfg)
    print(f"correct: {len(shapes)} shapes x {len(configs)} configs", flush=True)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        cfgs = [(16, 128, 1, 4, 2), (16, 128, 4, 4, 2), (32, 256, 3, 4, 2), (8, 64, 8, 4, 2)]
        check(torch.device("cpu"), torch.float32, [(96, 1024), (40, 700)], cfgs)
        return
    sys.path.insert(0, os.path.dirname(__file__))
    from graph_time import graph_time

    dev, dt = torch.device("cuda"), torch.bfloat16
    shapes = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "down": (4096, 14336)}
    # (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages): 72 per shape, each compiled for its shape
    configs = list(itertools.product((8, 16, 32), (256, 512), (1, 2, 4, 8), (4,), (2, 3, 4)))
    check(dev, dt, list(shapes.values()), [(16, 512, 4, 4, 3), (64, 256, 8, 8, 2)])
    report = {"shapes": {}}
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(32)]
        x = torch.randn(k, device=dev, dtype=dt)
        y = torch.empty(n, device=dev, dtype=dt)
        gb = n * k * 2 / 1e9
        t_cublas = graph_time(lambda i, ws=ws: torch.mv(ws[i], x, out=y))
        rows = []
        for cfg in configs:
            g = Gemv(n, k, *cfg, device=dev)
            try:
                t = graph_time(lambda i, g=g, ws=ws: g(x, ws[i], y))
            except Exception as e:  # a config that does not compile (shared memory, registers)
                rows.append({"cfg": cfg, "error": type(e).__name__})
                continue
            # after 20 graph replays: still right (a split reduced before all partials landed,
            # or a counter left non-zero, shows here)
            want = torch.mv(ws[1], x).float()
            g(x, ws[1], y)
            err = (y.float() - want).abs().max().item()
            if err > 2e-2 * max(1.0, want.abs().max().item()) or int(g.count.sum()) != 0:
                rows.append({"cfg": cfg, "error": f"wrong result (max err {err:.3g})"})
                continue
            rows.append({"cfg": cfg, "us": t * 1e6, "TBps": gb / t / 1e3})
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        best = ok[0]
        report["shapes"][name] = {"n": n, "k": k, "cublas_us": t_cublas * 1e6,
                                  "cublas_TBps": gb / t_cublas / 1e3, "top": ok[:8],
                                  "failed": [r for r in rows if "error" in r]}
        print(f"{name:7s} cuBLAS {t_cublas*1e6:6.2f} us {gb/t_cublas/1e3:4.2f} TB/s | best gemv "
              f"{best['us']:6.2f} us {best['TBps']:4.2f} TB/s cfg (BN, BK, SK, warps, stages) "
              f"{best['cfg']}", flush=True)
        del ws
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gemv_sweep.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
