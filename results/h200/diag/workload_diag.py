"""Device diagnostic (session 6): per-step device spans of the 256-request run (prompts 32-512,
256 tokens). Prefill alone (prefill_diag.py) runs its 66k prompt tokens in ~1.5 s of kernels,
yet `bench profile --workload 256` counted 2.9 s of busy time in the run's 9 non-decode steps:
this prints every step's rows, how many of them sample, the host time of its launch and the
device span between its events, to see which steps are slow and why."""

import gc
import json
import os
import time

import torch

from specserve import LLM, SamplingParams
from specserve.bench.datasets import random_requests

n = int(os.environ.get("DIAG_N", "256"))
max_tokens = int(os.environ.get("DIAG_TOKENS", "256"))
llm = LLM(model=os.environ.get("DIAG_MODEL", "dummy:llama-3.1-8b"),
          dtype=os.environ.get("DIAG_DTYPE", "bfloat16"), max_num_seqs=n,
          max_model_len=512 + max_tokens + 16, enable_prefix_caching=False, progress=False)
eng = llm.engine
vocab = eng.model_config.vocab_size
reqs = random_requests(n, (32, 512), max_tokens, vocab, seed=0)
prompts = [r.prompt_token_ids for r in reqs]
sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
warm = random_requests(n, (32, 512), 16, vocab, seed=1)
llm.generate([r.prompt_token_ids for r in warm], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.synchronize()
log = []
orig_launch = eng._launch


def launch(batch, overlap):
    t0 = time.perf_counter()
    r = orig_launch(batch, overlap)
    log.append({"rows": batch.num_rows, "reqs": len(batch.seqs), "sampling": sum(batch.samples),
                "overlap": overlap, "launch_ms": round((time.perf_counter() - t0) * 1e3, 2)})
    return r


eng._launch = launch
gcs = []  # (generation, ms, step index) of every collection in the timed run
_gc_t0 = [0.0]


def on_gc(phase, info):
    if phase == "start":
        _gc_t0[0] = time.perf_counter()
    else:
        gcs.append((info["generation"], round((time.perf_counter() - _gc_t0[0]) * 1e3, 2), len(log)))


def compiled() -> dict:
    """Compiled variants per Triton kernel of ours (JIT caches), to see compiles mid-run."""
    import importlib
    out = {}
    for mod in ("specserve.ops.triton_kv", "specserve.ops.triton_verify", "specserve.ops.triton_fused"):
        try:
            m = importlib.import_module(mod)
        except ImportError:  # no triton (CPU check of this script)
            continue
        for name in dir(m):
            k = getattr(m, name)
            caches = getattr(k, "device_caches", None)
            if isinstance(caches, dict):
                out[name] = sum(len(v[0]) for v in caches.values())
    return out


before = compiled()
gc.callbacks.append(on_gc)
eng.timeline.start()
t0 = time.perf_counter()
llm.generate(prompts, sp, use_tqdm=False)
wall = time.perf_counter() - t0
eng.timeline.stop()
ev = [(s, e, t) for s, e, t in eng.timeline._events if e is not None]
if ev:
    ev[-1][1].synchronize()
for i, (s, e, t) in enumerate(ev[: len(log)]):
    log[i]["tag"] = t
    log[i]["span_ms"] = round(s.elapsed_time(e), 2)
    if i + 1 < len(ev):
        log[i]["gap_ms"] = round(e.elapsed_time(ev[i + 1][0]), 3)
gc.callbacks.remove(on_gc)
after = compiled()
print("triton variants before/after the timed run:", {k: (before.get(k), v) for k, v in after.items()})
print("gc collections (gen, ms, step):", [g for g in gcs if g[0] == 2 or g[1] > 5])
print(f"wall {wall:.2f} s, {len(log)} steps, {n * max_tokens / wall:.0f} tok/s")
by = {}
for x in log:
    k = "decode" if x.get("tag") == "decode" else "other"
    b = by.setdefault(k, {"steps": 0, "span_ms": 0.0, "launch_ms": 0.0})
    b["steps"] += 1
    b["span_ms"] += x.get("span_ms", 0.0)
    b["launch_ms"] += x["launch_ms"]
print(by)
for i, x in enumerate(log):
    if x.get("tag") != "decode" or i < 3 or i % 40 == 0 or x.get("span_ms", 0) > 30:
        print(i, x)
json.dump({"wall_s": wall, "summary": by, "steps": log, "gc": gcs, "triton_variants": [before, after]},
          open(os.path.join(os.environ.get("OUT", "."), "workload_diag.json"), "w"), indent=1)
