"""`specserve bench cpu-profile`: where a CPU decode step's time goes.

Runs decode workloads (one request, then N at once) through `LLM.generate` twice: plain, for the
tokens/s the run really gets, then instrumented with wall-clock timers around the engine's
pieces. On the CPU every op is synchronous, so a timer around a module is that module's cost.
Only decode-shaped steps (every row wants logits: no prompt chunk) are counted.

Timers are forward hooks on the model's modules and wrappers set on the engine's objects for the
instrumented run only (removed after it); they cost a few microseconds each, so the instrumented
step is a little slower than the plain one (both are reported). The instrumented run keeps one
call per op (SPECSERVE_CPU_LAYER=off): the compiled layer stack (model/cpu_stack.py) would run
the layers without calling the modules the timers hook; the plain run uses the default.

Parts of a step (ms per decode step):
  gemm.<proj>      qkv_proj, o_proj, gate_up_proj, down_proj summed over layers; lm_head
  attention        rope, KV write and paged attention (attention block minus its two GEMMs)
  layer_other      norms, residual adds, SiLU-and-mul (decoder layers minus attention and MLP GEMMs)
  model_other      embedding lookup, rotary gather, final norm
  runner_other     the runner's forward around the model (fed ids, logit rows gather)
  sampling         sampler plan + execute (sampling, verification, readback)
  schedule, prepare, ledger, detokenize   host Python (ledger excludes detokenize)
  engine_other     the rest of LLMEngine.step
  outside_step     LLM.generate between two steps (collecting outputs)
With overlap on (--overlap, CPU worker thread) the forward runs beside the host work and the
parts overlap: they no longer sum to the step.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from specserve import env
from specserve.bench.datasets import BenchRequest, random_requests
from specserve.sampling_params import SamplingParams

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
PARTS = (
    *(f"gemm.{p}" for p in PROJECTIONS),
    "gemm.lm_head",
    "attention",
    "layer_other",
    "model_other",
    "runner_other",
    "sampling",
    "schedule",
    "prepare",
    "ledger",
    "detokenize",
    "engine_other",
    "outside_step",
)


class StepTimers:
    """Seconds per timer key within the current step; folded into totals when the step was
    decode-shaped, dropped otherwise (prefill steps cost per row what decode does not)."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self.total: dict[str, float] = defaultdict(float)
        self.decode_steps = 0
        self.decode_rows = 0
        self.decode_shaped = False
        self.rows = 0

    def add(self, key: str, seconds: float) -> None:
        self.step[key] += seconds

    def wrap(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.step[key] += time.perf_counter() - t0

        return timed

    def end_step(self) -> None:
        if self.decode_shaped:
            for k, v in self.step.items():
                self.total[k] += v
            self.decode_steps += 1
            self.decode_rows += self.rows
        self.step.clear()
        self.decode_shaped = False
        self.rows = 0

    def parts_ms(self) -> dict[str, float]:
        """Mean ms per decode step of each part of PARTS (exclusive times, see the module doc)."""
        t, n = self.total, max(1, self.decode_steps)
        gemm = {p: t[f"gemm.{p}"] for p in PROJECTIONS}
        attn = t["attn_block"] - gemm["qkv_proj"] - gemm["o_proj"]
        layers = t["layers"] - t["attn_block"] - gemm["gate_up_proj"] - gemm["down_proj"]
        runner = t["runner.forward"] - t["model"] - t["gemm.lm_head"]
        ledger = t["ledger"] - t["detokenize"]
        step_parts = (
            t["runner.forward"] + t["sampling"] + t["schedule"] + t["prepare"] + t["ledger"]
        )
        seconds = {
            **{f"gemm.{p}": v for p, v in gemm.items()},
            "gemm.lm_head": t["gemm.lm_head"],
            "attention": attn,
            "layer_other": layers,
            "model_other": t["model"] - t["layers"],
            "runner_other": runner,
            "sampling": t["sampling"],
            "schedule": t["schedule"],
            "prepare": t["prepare"],
            "ledger": ledger,
            "detokenize": t["detokenize"],
            "engine_other": t["engine.step"] - step_parts,
            "outside_step": t["outside_step"],
        }
        return {k: 1e3 * v / n for k, v in seconds.items()}


def _kind(name: str) -> str | None:
    for p in PROJECTIONS:
        if name.endswith(p):
            return p
    return None


@contextlib.contextmanager
def instrument(llm: Any) -> Iterator[StepTimers]:
    """Timers on the engine's pieces for the duration of the block."""
    import torch

    eng = llm.engine
    timers = StepTimers()
    model = eng.runner.model
    handles = []
    starts: dict[int, float] = {}

    def timed_module(mod: torch.nn.Module, key: str) -> None:
        def pre(m: torch.nn.Module, args: Any) -> None:
            starts[id(m)] = time.perf_counter()

        def post(m: torch.nn.Module, args: Any, out: Any) -> None:
            timers.add(key, time.perf_counter() - starts[id(m)])

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))

    for name, mod in model.named_modules():
        kind = _kind(name)
        if kind is not None:
            timed_module(mod, f"gemm.{kind}")
        elif name.endswith("self_attn"):
            timed_module(mod, "attn_block")
    timed_module(model, "model")
    for layer in model.layers:
        timed_module(layer, "layers")

    patched: list[tuple[Any, str]] = []

    def patch(obj: Any, attr: str, key: str) -> None:
        setattr(obj, attr, timers.wrap(key, getattr(obj, attr)))
        patched.append((obj, attr))

    patch(model, "compute_logits", "gemm.lm_head")
    patch(eng.runner, "forward", "runner.forward")
    patch(eng.runner, "prepare", "prepare")
    patch(eng.sampler, "plan", "sampling")
    patch(eng.sampler, "execute", "sampling")
    patch(eng.ledger, "process_outputs", "ledger")

    schedule = eng.scheduler.schedule

    def timed_schedule(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        batch = schedule(*args, **kwargs)
        timers.add("schedule", time.perf_counter() - t0)
        timers.decode_shaped = not batch.is_empty and batch.is_decode_shaped
        timers.rows = batch.num_rows
        return batch

    eng.scheduler.schedule = timed_schedule
    patched.append((eng.scheduler, "schedule"))

    add_request = eng.add_request

    def add_and_time_detokenizer(*args: Any, **kwargs: Any) -> Any:
        seq = add_request(*args, **kwargs)
        detok = seq.detokenizer
        if detok is not None:
            for attr in ("append", "take_delta", "flush"):
                setattr(detok, attr, timers.wrap("detokenize", getattr(detok, attr)))
        return seq

    eng.add_request = add_and_time_detokenizer
    patched.append((eng, "add_request"))

    step = eng.step
    last_end: list[float | None] = [None]

    def timed_step() -> Any:
        t0 = time.perf_counter()
        if last_end[0] is not None:
            timers.add("outside_step", t0 - last_end[0])
        try:
            return step()
        finally:
            end = time.perf_counter()
            timers.add("engine.step", end - t0)
            last_end[0] = end
            timers.end_step()

    eng.step = timed_step
    patched.append((eng, "step"))
    try:
        with env.override(cpu_layer="off"):  # hooks need the modules called (module doc)
            yield timers
    finally:
        for h in handles:
            h.remove()
        for obj, attr in patched:
            delattr(obj, attr)  # the class's method shows through again


def _generate(llm: Any, requests: list[BenchRequest], seed: int) -> tuple[float, int]:
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True, seed=seed)
        for r in requests
    ]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def profile_workload(llm: Any, requests: list[BenchRequest], seed: int = 0) -> dict[str, Any]:
    """One workload: a plain timed run, then an instrumented one; their step breakdown."""
    plain_s, tokens = _generate(llm, requests, seed)
    with instrument(llm) as timers:
        inst_s, _ = _generate(llm, requests, seed)
    parts = timers.parts_ms()
    step_ms = sum(parts.values())
    gemm_ms = sum(v for k, v in parts.items() if k.startswith("gemm."))
    n = max(1, timers.decode_steps)
    return {
        "requests": len(requests),
        "output_tokens": tokens,
        "plain_seconds": plain_s,
        "plain_output_tok_s": tokens / plain_s,
        "instrumented_seconds": inst_s,
        "decode_steps": timers.decode_steps,
        "rows_per_decode_step": timers.decode_rows / n,
        "decode_step_ms": step_ms,
        "gemm_ms": gemm_ms,
        "parts_ms": parts,
        "parts_share": {k: v / step_ms for k, v in parts.items()} if step_ms else {},
    }


def format_profile(name: str, w: dict[str, Any]) -> str:
    lines = [
        f"{name}: {w['requests']} request(s), {w['decode_steps']} decode steps of "
        f"{w['rows_per_decode_step']:.1f} rows, {w['decode_step_ms']:.2f} ms/step instrumented; "
        f"plain run {w['plain_output_tok_s']:.1f} output tok/s"
    ]
    for k, v in sorted(w["parts_ms"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {k:<20} {v:9.3f} ms  {100 * w['parts_share'].get(k, 0):5.1f} %")
    return "\n".join(lines)


def add_cpu_profile_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "cpu-profile",
        help="where a CPU decode step's time goes (GEMMs, attention, sampling, host Python)",
        description="Decode workloads at batch 1 and at --num-prompts requests, timed plain and "
        "then with timers around the engine's pieces; reports ms per decode step by part.",
    )
    from specserve.cli.main import add_engine_args

    add_engine_args(p)
    p.add_argument(
        "--batch-sizes",
        default="1,64",
        help="comma-separated requests run at once, one workload each (default 1,64)",
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (random ids)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--json", dest="json_path", default=None, help="write the report here")
    return p


def run_cpu_profile(args: argparse.Namespace) -> dict[str, Any]:
    from specserve import LLM
    from specserve.bench.report import hardware_info, software_info, timestamp, write_json
    from specserve.cli.main import engine_kwargs

    try:
        sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(
            f"error: --batch-sizes must be integers, got {args.batch_sizes!r}"
        ) from None
    if not sizes or min(sizes) < 1 or args.input_len < 1 or args.max_tokens < 1:
        raise SystemExit("error: batch sizes, --input-len and --max-tokens must be >= 1")
    kw = engine_kwargs(args)
    kw["device"] = "cpu" if kw.get("device") == "auto" else kw.get("device")
    kw["max_num_seqs"] = max(kw.get("max_num_seqs") or 1, *sizes)
    llm = LLM(progress=False, **kw)
    vocab = min(int(llm.engine.model_config.vocab_size), len(llm.tokenizer))
    warm = random_requests(1, (8, 8), 4, vocab, seed=args.seed + 1)
    _generate(llm, warm, args.seed)
    workloads = {}
    for b in sizes:
        reqs = random_requests(
            b, (args.input_len, args.input_len), args.max_tokens, vocab, args.seed
        )
        w = profile_workload(llm, reqs, args.seed)
        workloads[f"batch{b}"] = w
        print(format_profile(f"batch{b}", w), flush=True)
    eng = llm.engine
    report = {
        "benchmark": "cpu-profile",
        "timestamp": timestamp(),
        "model": llm.model_name,
        "dtype": str(eng.dtype).removeprefix("torch."),
        "quantization": eng.config.quantization,
        "overlap": bool(eng.overlap),
        "input_len": args.input_len,
        "max_tokens": args.max_tokens,
        "hardware": hardware_info(),
        "software": software_info(),
        "workloads": workloads,
    }
    if args.json_path:
        write_json(report, args.json_path)
        print(f"report written to {args.json_path}")
    return report
