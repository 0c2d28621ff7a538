"""`specserve bench host-profile`: the host's microseconds per decode step, by phase.

    specserve bench host-profile --model dummy:tiny --batch-sizes 1,256 --json host.json

A Python engine reaches the device's speed only if each step's host work (scheduling, input
building, the ledger, detokenization, output objects) fits under the device's step time. This
measures that work on any machine: B requests of random prompt tokens (ignore_eos, greedy, so
the device part stays small) are prefilled in one step and decode together to the end; every
step from the third with all of them decoding is timed, the one that finishes them included
(work deferred to a request's end counts), in three passes:

- coarse: only the step loop and the device's part are timed. `host_cpu_us`: CPU time of the
  engine's thread per step less the device's part (the forward and sampling, inline; under
  --overlap on CPU they run in a worker thread and the wait for it costs no CPU), robust to the
  other processes of a shared machine; `host_us`: the same on the wall clock. `mean` covers
  every timed step, the finishing one included; `median` is a steady decode step;
- phases: the per-step phases below wrapped too, on the thread CPU clock; exclusive time per
  phase (a phase's nested phases are subtracted), so the phases add up to the period. The
  ledger includes its per-token parts;
- tokens: those wrapped too (detokenize, outputs), splitting the ledger; each wrapped call
  costs ~0.5 us and they run per token, so this split is inflated and only read as shares.

Phases: schedule (Scheduler.schedule), prepare (ModelRunner.prepare: the step's inputs), plan
(StepSampler.plan, or pack_tail for a step sampling in its graph: the sampler's per-row
inputs), launch (the rest of Launcher.launch),
readback (SampledStep.wait: results to host lists), ledger (Ledger.process_outputs less the
two below), detokenize (IncrementalDetokenizer), outputs (the ledger's pooled TokenOutputs and
the consumer's copies of them), engine (the rest of LLMEngine.step), consumer (the caller's
loop outside step(), less the copies), device and device_wait (not host work).

What makes the CPU stand in for an H200's host: --layout bucket (default) lays decode steps out
as the CUDA graphs do (DecodeGraphs.prepare, one packed upload) and runs that layout eagerly;
glibc keeps freed memory (keep_freed_memory) and start-up objects are frozen out of the
collector, as a CUDA engine does. Not separable here: the kernel launches of the forward and
sampling, host work on CUDA, are inside `device` on CPU. On CUDA the engine runs its CUDA
graphs as served, `device` is the host's launching (graph replays, the eager sampling and device
drafting), and readback includes the wait for the device when the host is ahead of it. The CPU forward between two steps evicts the
host code's caches (an H200's host keeps them warmer): a phase costs here up to several times
what it costs in a hot loop, most at batch 1.
The spread over whole runs comes from running the command several times (code versions cannot
be interleaved in one process).
"""

from __future__ import annotations

import argparse
import functools
import gc
import random
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

DEVICE_PHASES = ("device", "device_wait")
TOKEN_PHASES = ("detokenize", "outputs")
WARM_STEPS = 3  # steps with every request decoding before the timed ones
PHASES = (
    "schedule",
    "prepare",
    "plan",
    "launch",
    "readback",
    "ledger",
    "draft",
    "detokenize",
    "outputs",
    "engine",
    "consumer",
    *DEVICE_PHASES,
)


def keep_freed_memory() -> bool:
    """glibc: serve every allocation from the heap and never give freed memory back. A step's
    CPU logits ([B, vocab] float32, 50 MB at B = 256) are otherwise mmapped fresh each step and
    unmapped when freed, page faults and munmap landing in whatever host phase drops the last
    reference; a device's caching allocator has no such cost. False where it does not apply."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        m_trim_threshold, m_mmap_max = -1, -4  # mallopt's parameter numbers (malloc.h)
        return bool(libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, 2**31 - 1))
    except (OSError, AttributeError, TypeError):
        return False


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def add_host_profile_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "host-profile",
        help="host microseconds per decode step, by phase (schedule, inputs, ledger, ...)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_args(p)
    return p


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="dummy:tiny", help="model (default: dummy:tiny)")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 256], help="e.g. 1,256")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (random ids)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per pass")
    p.add_argument(
        "--consumer",
        choices=("generate", "stream", "engine"),
        default="generate",
        help="generate: LLM.generate (offline); stream: LLM.stream (an output object per token "
        "handed out); engine: LLMEngine.step alone, reading each output's text",
    )
    p.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="overlap scheduling (CUDA's default). Off by default here: on CPU it runs the "
        "forward in a worker thread whose Python contends for the GIL with the host phases",
    )
    p.add_argument(
        "--layout",
        choices=("bucket", "eager"),
        default="bucket",
        help="bucket: decode steps take CUDA's graph layout (one packed upload), run eagerly, "
        "so prepare is the H200's host work; eager: the CPU engine's own step inputs",
    )
    p.add_argument("--stop", action="append", default=[], help="a stop string for every request")
    p.add_argument(
        "--speculative-config",
        default=None,
        help='speculation, as for `generate` (e.g. \'{"method": "eagle3", '
        '"num_speculative_tokens": 5}\'); golden drafts get random golden ids. Host drafters '
        "(no --overlap) time their drafting as the draft phase; device drafters draft inside "
        "the device part",
    )
    p.add_argument("--dtype", default="float32", help="auto, float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda")
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU forward)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--json", dest="json_path", default=None, help="write the report here")


class _NoCapture:
    """A graph backend that captures nothing: with capture=False the bucket layout runs eagerly."""

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        return fn


class PhaseClock:
    """Exclusive seconds per phase by `timer`, for the thread that built it: a wrapped call's
    time less that of the wrapped calls inside it. Calls from other threads (the CPU worker)
    pass through untimed."""

    def __init__(self, timer: Callable[[], float] = time.perf_counter) -> None:
        self.timer = timer
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []  # per open call: seconds of its timed children
        self._thread = threading.get_ident()
        self._undo: list[tuple[Any, str, Any, bool]] = []

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        had_own = isinstance(owner, type) or name in vars(owner)
        fn = getattr(owner, name)
        self._undo.append((owner, name, vars(owner).get(name), had_own))
        clock, timer = self, self.timer

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != clock._thread:
                return fn(*args, **kwargs)
            frame = [0.0]
            clock._stack.append(frame)
            t0 = timer()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = timer() - t0
                clock._stack.pop()
                clock.totals[phase] += dt - frame[0]
                if clock._stack:
                    clock._stack[-1][0] += dt

        setattr(owner, name, timed)

    def unwrap(self) -> None:
        for owner, name, old, had_own in reversed(self._undo):
            if had_own and old is not None:
                setattr(owner, name, old)
            else:  # an instance's: its class attribute shows through again
                vars(owner).pop(name, None)
        self._undo.clear()


def _instrument(clock: PhaseClock, llm: Any, level: int) -> None:
    """Level 0: the device's part only; 1: every per-step phase too; 2: and the per-token
    ones (detokenize, outputs), each wrapped call costing ~0.5 us."""
    from specserve import step_launch as launch_mod
    from specserve.engine.detokenizer import IncrementalDetokenizer
    from specserve.engine.outputs import TokenOutput
    from specserve.runner.graph_tail import SampledTail
    from specserve.runner.step_sampler import SampledStep

    eng = llm.engine
    if level:
        clock.wrap(eng, "step", "engine")
    clock.wrap(eng.runner, "forward", "device")
    clock.wrap(eng.sampler, "execute", "device")
    clock.wrap(launch_mod.WorkerStep, "wait", "device_wait")
    if not level:
        return
    clock.wrap(eng.scheduler, "schedule", "schedule")
    clock.wrap(eng.runner, "prepare", "prepare")
    clock.wrap(eng.sampler, "plan", "plan")
    clock.wrap(launch_mod, "pack_tail", "plan")  # a step sampling in its graph's tail
    clock.wrap(eng.launcher, "launch", "launch")
    clock.wrap(SampledStep, "wait", "readback")
    clock.wrap(SampledTail, "wait", "readback")
    clock.wrap(eng.ledger, "process_outputs", "ledger")
    if eng.speculator is not None:  # host drafting (with device drafting: inside the device)
        clock.wrap(eng.speculator, "propose", "draft")
    if level < 2:
        return
    clock.wrap(eng.ledger, "_token_output", "outputs")
    for name in ("append", "take_delta", "flush"):
        clock.wrap(IncrementalDetokenizer, name, "detokenize")
    clock.wrap(TokenOutput, "clone", "outputs")


def _consume(llm: Any, prompts: list[list[int]], params: list[Any], consumer: str) -> None:
    """Run the requests to the end as a caller would."""
    if consumer == "generate":
        llm.generate(prompts, params, use_tqdm=False)
    elif consumer == "stream":
        for _ in llm.stream(prompts, params):
            pass
    else:
        eng = llm.engine
        for p, sp in zip(prompts, params):
            eng.add_request(p, sp)
        while eng.has_unfinished():
            for out in eng.step():
                out.text  # noqa: B018 - what a caller reads: the token's text
        eng.release_outputs()


def _percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "p25": q[0], "p75": q[2], "mean": statistics.mean(xs)}


def _timed_pass(
    llm: Any, batch: int, args: argparse.Namespace, clocks: list[PhaseClock], level: int
) -> list[list[dict[str, float]]]:
    """`batch` requests of args.steps + a few tokens, prefilled in one step and run to their
    end; every step from the third with all of them decoding is timed, through the one that
    finishes them and the caller's work after it. Per clock, per step: the loop period split
    by phase (seconds)."""
    from specserve import SamplingParams

    eng = llm.engine
    rng = random.Random(args.seed + batch)
    bound = min(eng.model_config.vocab_size, len(llm.tokenizer) if llm.tokenizer else 1 << 30)
    prompts = [[rng.randrange(3, bound) for _ in range(args.input_len)] for _ in range(batch)]
    n = WARM_STEPS + args.steps
    spec = eng.config.speculative_config
    golden = spec is not None and spec.method == "golden"
    params = [
        SamplingParams(
            max_tokens=n,
            ignore_eos=True,
            temperature=0.0,
            stop=args.stop,
            golden_token_ids=[rng.randrange(3, bound) for _ in range(n)] if golden else None,
        )
        for _ in prompts
    ]
    marks: list[list[tuple[float, dict[str, float]]]] = [[] for _ in clocks]
    tokens: list[int] = []
    warm = [0]
    for clock in clocks:
        _instrument(clock, llm, level)
    step, sched = eng.step, eng.scheduler

    def mark() -> None:
        for clock, m in zip(clocks, marks):
            m.append((clock.timer(), dict(clock.totals)))

    def marked_step() -> Any:
        if warm[0] < WARM_STEPS and len(sched.running) == batch and not sched.waiting:
            warm[0] += 1
        timing = warm[0] == WARM_STEPS
        if timing:
            mark()
        out = step()
        if timing:
            tokens.append(sum(o.token_id >= 0 for o in out))
        return out

    eng.step = marked_step
    try:
        _consume(llm, prompts, params, args.consumer)
        mark()  # the caller's work after the last step
    finally:
        for clock in reversed(clocks):
            clock.unwrap()  # marked_step too: it replaced the timed step
    if not tokens:
        raise RuntimeError("no steady decode step was timed")
    out = []
    for m in marks:
        steps = []
        for i in range(len(tokens)):
            (t0, a), (t1, b) = m[i], m[i + 1]
            ph = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in PHASES}
            ph["consumer"] = t1 - t0 - sum(ph.values())
            device = sum(ph[k] for k in DEVICE_PHASES)
            steps.append({"period": t1 - t0, "host": t1 - t0 - device, "tokens": tokens[i], **ph})
        out.append(steps)
    return out


def profile_batch(llm: Any, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """Three passes: coarse (wall and thread CPU clocks, the device's part only), phases (per
    step, CPU clock: ~1 us per reading, a dozen a step), tokens (the ledger's per-token parts
    too, wall clock: its readings are cheaper)."""
    wall, cpu = _timed_pass(llm, batch, args, [PhaseClock(), PhaseClock(time.thread_time)], 0)
    (phases,) = _timed_pass(llm, batch, args, [PhaseClock(time.thread_time)], 1)
    (tokens,) = _timed_pass(llm, batch, args, [PhaseClock()], 2)

    def us(steps: list[dict[str, float]], key: str) -> dict[str, float]:
        return {k: v * 1e6 for k, v in _percentiles([s[key] for s in steps]).items()}

    host_phases = [k for k in PHASES if k not in DEVICE_PHASES and k not in TOKEN_PHASES]
    return {
        "batch": batch,
        "steps": len(wall),
        "tokens_per_step": statistics.median(s["tokens"] for s in wall),
        # CPU time of the engine's thread: what a loaded machine's other processes leave alone
        "host_cpu_us": us(cpu, "host"),
        "host_us": us(wall, "host"),
        "device_us": us(wall, "device")["median"] + us(wall, "device_wait")["median"],
        "period_us": us(wall, "period"),
        "phases_host_us": us(phases, "host"),
        "phases_us": {k: us(phases, k)["median"] for k in host_phases},
        "phases_mean_us": {k: us(phases, k)["mean"] for k in host_phases},
        # the ledger split by the per-token pass (instrumented: each part inflated by its calls)
        "ledger_split_mean_us": {k: us(tokens, k)["mean"] for k in ("ledger", *TOKEN_PHASES)},
    }


def run(args: argparse.Namespace, emit: Callable[[str], None] = print) -> dict[str, Any]:
    import torch

    from specserve import LLM
    from specserve.bench.common import command_line
    from specserve.bench.report import hardware_info, software_info, timestamp, write_json
    from specserve.config import SpeculativeConfig

    spec = SpeculativeConfig.parse(args.speculative_config)
    k = spec.num_speculative_tokens if spec else 0
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # restored below: the caller's process (tests) goes on
    heap_only = keep_freed_memory()
    top = max(args.batch_sizes)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=top,
        max_model_len=args.input_len + WARM_STEPS + args.steps + 16 + k,
        # every prompt in one step: the requests decode, and finish, together
        max_num_batched_tokens=max(2048, top * args.input_len),
        enforce_eager=not cuda,  # CUDA: the graphs as served; their launches are host work there
        enable_prefix_caching=False,
        overlap=args.overlap,
        speculative_config=spec,
        progress=False,
    )
    eng = llm.engine
    if eng.device.type != "cuda":
        # as a CUDA engine does after start-up: the model and tokenizer out of the collector's
        # walks, whose full collections would land in whichever host phase triggers them
        gc.collect()
        gc.freeze()
    if args.layout == "bucket" and eng.runner.graphs is None:
        eng.runner.init_cuda_graphs(
            top, 1 + k, eng.max_model_len, capture=False, progress=False, backend=_NoCapture()
        )
    results = []
    try:
        for b in args.batch_sizes:
            r = profile_batch(llm, b, args)
            results.append(r)
            phases = " ".join(f"{k} {v:.0f}" for k, v in r["phases_mean_us"].items())
            cpu, wall = r["host_cpu_us"], r["host_us"]
            emit(
                f"batch {b}: host {cpu['mean']:.0f} us/step CPU (median {cpu['median']:.0f}, "
                f"p25 {cpu['p25']:.0f}, p75 {cpu['p75']:.0f}), wall {wall['mean']:.0f} "
                f"(median {wall['median']:.0f}); device {r['device_us']:.0f} us"
            )
            emit(f"  mean by phase (instrumented: {r['phases_host_us']['mean']:.0f}): {phases}")
            split = " ".join(f"{k} {v:.0f}" for k, v in r["ledger_split_mean_us"].items())
            emit(f"  ledger, per-token pass: {split}")
    finally:
        gc.unfreeze()  # the caller's process (tests) collects as before
        torch.set_num_threads(threads)
    report = {
        "benchmark": "host-profile",
        "command": command_line(),
        "timestamp": timestamp(),
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "hardware": hardware_info(),
        "software": software_info(),
        "overlap": eng.overlap,
        "bucket_layout": eng.runner.graphs is not None,
        "heap_only_malloc": heap_only,
        "results": results,
    }
    if args.json_path:
        write_json(report, args.json_path)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_args(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
