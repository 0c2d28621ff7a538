"""Device diagnostic (session 6): where a prefill step of the 256-request run spends its time.

In `bench profile --workload 256` the 9 prefill steps took 2.9 s of device-busy time while the
kernels of the whole run summed to ~1.6 s for them. This runs the 256 prompts with max_tokens=1
(prefill only): per-step host times of launch and process, wall vs kernel time, and the host ops
by self CPU time under the profiler."""

import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specserve import LLM, SamplingParams
from specserve.bench.datasets import random_requests

def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


n = int(os.environ.get("DIAG_N", "256"))
llm = LLM(model=os.environ.get("DIAG_MODEL", "dummy:llama-3.1-8b"), dtype=os.environ.get("DIAG_DTYPE", "bfloat16"), max_num_seqs=n, max_model_len=784,
          enable_prefix_caching=False, progress=False)
eng = llm.engine
vocab = eng.model_config.vocab_size
reqs = random_requests(n, (32, 512), 1, vocab, seed=0)
prompts = [r.prompt_token_ids for r in reqs]
sp = SamplingParams(max_tokens=1, ignore_eos=True)
warm = random_requests(n, (32, 512), 1, vocab, seed=1)
llm.generate([r.prompt_token_ids for r in warm], sp, use_tqdm=False)
sync()

log = []
orig_launch, orig_process = eng._launch, eng._process


def launch(batch, overlap):
    t0 = time.perf_counter()
    r = orig_launch(batch, overlap)
    log.append({"rows": batch.num_rows, "reqs": len(batch.seqs), "launch_ms": (time.perf_counter() - t0) * 1e3})
    return r


def process(launched, out_step, draft):
    t0 = time.perf_counter()
    r = orig_process(launched, out_step, draft)
    log.append({"process_ms": (time.perf_counter() - t0) * 1e3, "rows": launched.batch.num_rows})
    return r


eng._launch, eng._process = launch, process
out = {}
for rep in range(2):
    log.clear()
    sync()
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    sync()
    wall = time.perf_counter() - t0
    print(f"rep {rep}: prefill-only run {wall * 1e3:.1f} ms, {sum(len(p) for p in prompts)} prompt tokens")
    for e in log:
        print("  ", {k: round(v, 2) if isinstance(v, float) else v for k, v in e.items()})
    out[f"rep{rep}"] = {"wall_ms": wall * 1e3, "log": list(log)}
eng._launch, eng._process = orig_launch, orig_process
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    sync()
    wall = time.perf_counter() - t0
ka = prof.key_averages()
dev = sum(getattr(e, "self_device_time_total", 0) for e in ka) / 1e3
print(f"profiled: wall {wall * 1e3:.1f} ms, kernels {dev:.1f} ms")
rows = sorted(ka, key=lambda e: e.self_cpu_time_total, reverse=True)[:30]
out["profiled"] = {"wall_ms": wall * 1e3, "device_ms": dev, "top_self_cpu": []}
for e in rows:
    d = {"name": e.key[:80], "self_cpu_ms": e.self_cpu_time_total / 1e3, "cpu_total_ms": e.cpu_time_total / 1e3,
         "count": e.count, "self_device_ms": getattr(e, "self_device_time_total", 0) / 1e3}
    out["profiled"]["top_self_cpu"].append(d)
    print(f"  {d['self_cpu_ms']:9.1f} ms self cpu {d['cpu_total_ms']:9.1f} total x{e.count:6d} dev {d['self_device_ms']:8.1f}  {e.key[:70]}")
krows = sorted(ka, key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)[:15]
for e in krows:
    print(f"  dev {getattr(e, 'self_device_time_total', 0) / 1e3:9.1f} ms x{e.count:6d}  {e.key[:90]}")
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "prefill_diag.json"), "w"), indent=1)
