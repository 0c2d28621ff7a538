"""`specserve bench golden-curve`: speculation speedup vs acceptance rate, per batch size.

Golden tokens make acceptance a dial with random weights: every request carries a golden
continuation that the verifier forces (with speculation off too), and the golden drafter proposes
it with each draft right with probability R. So for each batch size B the same B requests emit the
same tokens in every mode, and the only difference between modes is how many forward steps, of
how many rows each, it takes: exactly the cost/benefit of verifying k drafts at acceptance R.

One engine per mode (off, fixed k, optionally the auto verify budget), reused across batch sizes
(on CUDA an engine captures its graphs at start-up). Between acceptance rates the golden engine
is reused too, by re-dialling its drafter (--fresh-engines builds one per rate instead).
Prefix caching is off so a reused engine never gets a prompt for free.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from specserve.bench.common import (
    command_line,
    engine_kwargs,
    free_memory,
    golden_continuations,
    model_vocab_size,
    token_id_bound,
)
from specserve.bench.report import hardware_info, software_info, timestamp, write_json


@dataclass
class CurveSettings:
    model: str | None = None
    k: int = 4
    acceptance_rates: list[float] = field(default_factory=lambda: [0.0, 0.5, 0.8, 1.0])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 16, 64])
    input_len: int = 128
    max_tokens: int = 256
    auto: bool = False  # also run verify_budget "auto" at every rate
    repeats: int = 1  # timed runs per point; the median is reported
    fresh_engines: bool = False  # one engine per rate instead of re-dialling the drafter
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = 4096
    kv_cache_gb: float | None = None
    enforce_eager: bool = False
    seed: int = 0
    json_path: str | None = None
    plot_path: str | None = None

    def __post_init__(self) -> None:
        if self.k < 1 or self.max_tokens < 1 or self.input_len < 1 or self.repeats < 1:
            raise ValueError("k, max_tokens, input_len and repeats must be at least 1")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError("batch sizes must be at least 1")
        if any(not 0.0 <= r <= 1.0 for r in self.acceptance_rates):
            raise ValueError("acceptance rates must be in [0, 1]")
        need = self.input_len + self.max_tokens + self.k + 1
        if self.max_model_len is not None and self.max_model_len < need:
            raise ValueError(f"max_model_len {self.max_model_len} < {need} tokens per request")


@dataclass
class CurvePoint:
    mode: str  # "off" | "fixed" | "auto"
    acceptance_rate: float | None  # None for "off"
    batch_size: int
    output_tokens: int
    seconds: float  # median over repeats: prefill + decode of the whole batch
    decode_seconds: float | None  # first token of the batch to the last one
    steps: int
    mean_acceptance_length: float  # tokens per verify step of a drafting request
    expected_acceptance_length: float | None  # (1 - R^(k+1)) / (1 - R); None for "off"
    acceptance_per_position: list[float]
    draft_rows_per_step: float
    outputs_match_golden: bool
    speedup: float | None = None  # output tok/s over "off" at the same batch size
    decode_speedup: float | None = None

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tok_s(self) -> float | None:
        if not self.decode_seconds:
            return None
        return (self.output_tokens - self.batch_size) / self.decode_seconds

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"tok_s": self.tok_s, "decode_tok_s": self.decode_tok_s}


def expected_acceptance_length(rate: float, k: int) -> float:
    """Tokens per verify step when each of k drafts is right with probability `rate`."""
    return float(k + 1) if rate >= 1.0 else (1.0 - rate ** (k + 1)) / (1.0 - rate)


def _spec_config(s: CurveSettings, mode: str, rate: float | None) -> dict[str, Any] | None:
    if mode == "off":
        return None
    return {
        "method": "golden",
        "num_speculative_tokens": s.k,
        "acceptance_rate": rate,
        "verify_budget": "auto" if mode == "auto" else "off",  # "off": all k really verified
    }


def _make_llm(s: CurveSettings, mode: str, rate: float | None) -> Any:
    from specserve import LLM

    return LLM(
        model=s.model,
        dtype=s.dtype,
        device=s.device,
        max_num_seqs=max(s.batch_sizes),
        speculative_config=_spec_config(s, mode, rate),
        seed=s.seed,
        progress=False,
        **engine_kwargs(s.max_model_len, s.kv_cache_gb, s.enforce_eager, False),
    )


def redial(llm: Any, rate: float) -> bool:
    """Set a golden engine's acceptance rate in place; False when its drafter has no such dial
    (then the caller builds a fresh engine). The golden drafter draws per draft from `rate`."""
    drafter = getattr(llm.engine, "drafter", None)
    if drafter is None or not hasattr(drafter, "rate"):
        return False
    drafter.rate = rate
    llm.engine.config.speculative_config.acceptance_rate = rate
    return True


def _counters(llm: Any) -> dict[str, Any]:
    spec = llm.engine.ledger.spec
    return {
        "drafts": spec.num_drafts,
        "draft_tokens": spec.num_draft_tokens,
        "accepted": spec.num_accepted_tokens,
        "accepted_pp": list(getattr(spec, "accepted_per_position", [])),
        "verified_pp": list(getattr(spec, "verified_per_position", [])),
        "steps": llm.engine.num_steps,
    }


def _delta_per_position(before: dict[str, Any], after: dict[str, Any]) -> list[float]:
    def sub(a: list[int], b: list[int]) -> list[int]:
        return [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]

    acc = sub(after["accepted_pp"], before["accepted_pp"])
    ver = sub(after["verified_pp"], before["verified_pp"])
    return [a / v if v else 0.0 for a, v in zip(acc, ver)]


@dataclass
class Workload:
    prompts: list[list[int]]
    golden: list[list[int]]


def build_workloads(s: CurveSettings, llm: Any) -> dict[int, Workload]:
    """One request set per batch size (random prompts, golden continuations), for every mode."""
    from specserve.bench.datasets import random_requests

    out = {}
    for b in s.batch_sizes:
        reqs = random_requests(
            b, (s.input_len, s.input_len), s.max_tokens, model_vocab_size(llm), s.seed + b
        )
        gold = golden_continuations(b, s.max_tokens, token_id_bound(llm), f"{s.seed}:{b}")
        out[b] = Workload([r.prompt_token_ids for r in reqs], gold)
    return out


def run_point(s: CurveSettings, llm: Any, mode: str, rate: float | None, w: Workload) -> CurvePoint:
    from specserve import SamplingParams

    b = len(w.prompts)

    def params(n: int) -> list[SamplingParams]:
        return [
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, golden_token_ids=g[:n])
            for g in w.golden
        ]

    # warm-up on the same shapes (prefill of B prompts, a few verify steps): first-use costs
    # such as Triton compiles of the prefill kernels are not throughput
    llm.generate(w.prompts, params(min(s.max_tokens, 2 * (s.k + 1) + 1)), use_tqdm=False)
    before = _counters(llm)
    runs: list[tuple[float, float | None]] = []
    match = True
    tokens = 0
    for _ in range(s.repeats):
        t0 = time.perf_counter()
        outs = llm.generate(w.prompts, params(s.max_tokens), use_tqdm=False)
        secs = time.perf_counter() - t0
        toks = [list(o.outputs[0].token_ids) for o in outs]
        match &= toks == w.golden
        tokens = sum(len(t) for t in toks)
        firsts = [getattr(o.metrics, "first_token_time", None) for o in outs]
        lasts = [getattr(o.metrics, "finished_time", None) for o in outs]
        dec = None
        if None not in firsts and None not in lasts:
            dec = max(lasts) - min(firsts)
        runs.append((secs, dec))
    after = _counters(llm)
    drafts = after["drafts"] - before["drafts"]
    acc = after["accepted"] - before["accepted"]
    steps = (after["steps"] - before["steps"]) // s.repeats
    # the median run by wall time (upper median for even counts)
    secs, dec = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    return CurvePoint(
        mode=mode,
        acceptance_rate=rate,
        batch_size=b,
        output_tokens=tokens,
        seconds=secs,
        decode_seconds=dec if dec and dec > 0 else None,
        steps=steps,
        mean_acceptance_length=1.0 + acc / drafts if drafts else 1.0,
        expected_acceptance_length=None if rate is None else expected_acceptance_length(rate, s.k),
        acceptance_per_position=_delta_per_position(before, after),
        draft_rows_per_step=(after["draft_tokens"] - before["draft_tokens"])
        / max(after["steps"] - before["steps"], 1),
        outputs_match_golden=match,
    )


def _fill_speedups(points: list[CurvePoint]) -> None:
    off = {p.batch_size: p for p in points if p.mode == "off"}
    for p in points:
        base = off.get(p.batch_size)
        if base is None:
            continue
        p.speedup = p.tok_s / base.tok_s if base.tok_s else None
        if p.decode_tok_s and base.decode_tok_s:
            p.decode_speedup = p.decode_tok_s / base.decode_tok_s


def run_golden_curve(s: CurveSettings, verbose: bool = True) -> dict[str, Any]:
    modes: list[tuple[str, float | None]] = [("off", None)]
    modes += [("fixed", r) for r in s.acceptance_rates]
    if s.auto:
        modes += [("auto", r) for r in s.acceptance_rates]
    points: list[CurvePoint] = []
    workloads: dict[int, Workload] = {}
    llm: Any = None
    held = ""  # mode of the engine in `llm`
    engines = 0
    for mode, rate in modes:
        reuse = llm is not None and held == mode and not s.fresh_engines
        if not (reuse and rate is not None and redial(llm, rate)):
            llm = None
            free_memory()  # the previous engine's KV cache before the next one sizes its own
            llm = _make_llm(s, mode, rate)
            held, engines = mode, engines + 1
        if not workloads:
            workloads = build_workloads(s, llm)
        for b in s.batch_sizes:
            p = run_point(s, llm, mode, rate, workloads[b])
            points.append(p)
            if verbose:
                r = "-" if rate is None else f"{rate:.2f}"
                print(
                    f"{mode:>5} R={r:<4} B={b:<4} {p.tok_s:9.1f} tok/s  acceptance length "
                    f"{p.mean_acceptance_length:.2f}  steps {p.steps}",
                    flush=True,
                )
    llm = None
    free_memory()
    _fill_speedups(points)
    report: dict[str, Any] = {
        "benchmark": "golden-curve",
        "timestamp": timestamp(),
        "command": command_line(),
        "model": s.model,
        "settings": asdict(s),
        "hardware": hardware_info(),
        "software": software_info(),
        "engines_built": engines,
        "points": [p.to_dict() for p in points],
        "checks": {
            "outputs_match_golden": all(p.outputs_match_golden for p in points),
            "acceptance_off_dial": _off_dial(points),
        },
    }
    if verbose:
        print(format_curve_table(points))
        if not report["checks"]["outputs_match_golden"]:
            print("ERROR: some outputs differ from the golden tokens")
        for line in report["checks"]["acceptance_off_dial"]:
            print(f"WARNING: {line}")
    if s.json_path:
        write_json(report, s.json_path)
    if s.plot_path:
        from specserve.bench.plot_results import plot_golden_curve

        plot_golden_curve(report, s.plot_path)
    return report


def _off_dial(points: list[CurvePoint], tolerance: float = 0.15) -> list[str]:
    """Fixed-k points whose first-draft acceptance is far from the rate dialled in: a sign that
    re-dialling the engine did not take (or that the golden drafter changed)."""
    out = []
    for p in points:
        if p.mode == "fixed" and p.acceptance_rate is not None and p.acceptance_per_position:
            got = p.acceptance_per_position[0]
            if abs(got - p.acceptance_rate) > tolerance:
                out.append(
                    f"B={p.batch_size} R={p.acceptance_rate}: first drafts accepted {got:.2f}"
                )
    return out


def format_curve_table(points: list[CurvePoint]) -> str:
    head = ["B", "mode", "R", "tok/s", "speedup", "decode x", "acc len", "expected", "steps"]
    rows = [head]
    order = {"off": 0, "fixed": 1, "auto": 2}
    for p in sorted(points, key=lambda q: (q.batch_size, order.get(q.mode, 3))):
        rows.append(
            [
                str(p.batch_size),
                p.mode,
                "-" if p.acceptance_rate is None else f"{p.acceptance_rate:.2f}",
                f"{p.tok_s:.1f}",
                "-" if p.speedup is None else f"{p.speedup:.2f}x",
                "-" if p.decode_speedup is None else f"{p.decode_speedup:.2f}x",
                f"{p.mean_acceptance_length:.2f}",
                "-"
                if p.expected_acceptance_length is None
                else f"{p.expected_acceptance_length:.2f}",
                str(p.steps),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_golden_curve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "golden-curve",
        help="speculation speedup vs acceptance rate (golden drafts) at several batch sizes",
    )
    p.add_argument(
        "--model",
        default=None,
        help="model folder, hub id, .gguf or dummy:<preset> (default: the default model)",
    )
    p.add_argument("--k", type=int, default=4, help="drafts per request per step")
    p.add_argument(
        "--acceptance-rates", type=_floats, default=[0.0, 0.5, 0.8, 1.0], help="e.g. 0,0.5,1"
    )
    p.add_argument(
        "--batch-sizes", type=_ints, default=[1, 16, 64], help="requests at once, e.g. 1,16,64"
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (random)")
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens per request")
    p.add_argument("--auto", action="store_true", help="also run the auto verify budget")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per point (median)")
    p.add_argument("--fresh-engines", action="store_true", help="one engine per rate")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 (half)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--max-model-len", type=int, default=4096, help="tokens per request")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="default: the engine's")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs")
    p.add_argument("--seed", type=int, default=0, help="engine and dataset seed")
    p.add_argument("--json", dest="json_path", default=None, help="write the report here")
    p.add_argument("--plot", dest="plot_path", default=None, help="write a PNG chart here")


def settings_from_args(args: argparse.Namespace) -> CurveSettings:
    names = CurveSettings.__dataclass_fields__
    return CurveSettings(**{k: v for k, v in vars(args).items() if k in names})


def main(args: argparse.Namespace) -> int:
    report = run_golden_curve(settings_from_args(args))
    return 0 if report["checks"]["outputs_match_golden"] else 1
