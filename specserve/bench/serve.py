"""`specserve bench serve`: online serving benchmark against a running OpenAI-compatible server,
after `vllm bench serve`.

Requests stream from /v1/completions, arriving as a Poisson process (`--request-rate`, or a gamma
process with `--burstiness`) or all at once, optionally capped by `--max-concurrency`. Per request
we record TTFT, the gaps between streamed chunks (ITL), TPOT and end-to-end latency; output token
counts come from the server's usage (exact), not from re-tokenizing text. Speculation numbers are
the difference of the server's /metrics counters before and after the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from specserve.bench.datasets import BenchRequest

SPEC_COUNTERS = (
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
)


@dataclass
class ServeBenchSettings:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # served model name; None: the first one /v1/models lists
    tokenizer: str | None = None  # HF folder for ShareGPT lengths; None: the default model's
    dataset: str = "sharegpt"  # "sharegpt" | "random"
    num_prompts: int = 100
    request_rate: float = math.inf  # requests/s; inf: all at t=0
    burstiness: float = 1.0  # gamma shape of inter-arrival times; 1.0 = Poisson
    max_concurrency: int | None = None
    output_len: int | None = None  # fixed output tokens; None: ShareGPT's reference reply length
    input_len: int = 128  # random dataset
    vocab_size: int = 49152  # random dataset token ids
    ignore_eos: bool = False
    temperature: float = 0.0
    stream_granularity: str | None = None
    api_key: str | None = None
    ready_timeout: float = 0.0  # seconds to wait for /health before starting
    seed: int = 0
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    json_path: str | None = None
    plot_path: str | None = None


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0  # seconds since the benchmark began
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def build_requests(s: ServeBenchSettings) -> list[BenchRequest]:
    if s.dataset == "random":
        from specserve.bench.datasets import random_requests

        lo = max(1, s.input_len // 2)
        return random_requests(
            s.num_prompts, (lo, s.input_len), s.output_len or 128, s.vocab_size, s.seed
        )
    from specserve.bench.datasets import load_sharegpt

    if s.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(s.tokenizer, local_files_only=True)
    else:  # the default model's (SmolLM2), also what dummy: models use
        from specserve.model.loader import default_tokenizer

        tok = default_tokenizer()
    return load_sharegpt(s.num_prompts, tok, seed=s.seed, fixed_output_len=s.output_len)


async def _one(
    http: Any, s: ServeBenchSettings, req: BenchRequest, model: str, t0: float
) -> RequestResult:
    body: dict[str, Any] = {
        "model": model,
        "prompt": req.prompt or req.prompt_token_ids,
        "max_tokens": req.output_len,
        "temperature": s.temperature,
        "ignore_eos": s.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if s.stream_granularity:
        body["stream_granularity"] = s.stream_granularity
    res = RequestResult()
    start = time.perf_counter()
    res.start = start - t0
    last = start
    try:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = obj["error"].get("message", str(obj["error"]))
                    return res
                now = time.perf_counter()
                if obj.get("choices"):
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if obj.get("usage"):
                    res.prompt_tokens = obj["usage"]["prompt_tokens"]
                    res.output_tokens = obj["usage"]["completion_tokens"]
        res.e2e = time.perf_counter() - start
        res.ok = not res.error
    except Exception as e:  # a benchmark records failures instead of stopping
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _arrivals(s: ServeBenchSettings, n: int) -> Any:
    """Yield request indices at their arrival times."""
    rng = random.Random(s.seed)
    for i in range(n):
        yield i
        if math.isinf(s.request_rate) or s.request_rate <= 0:
            continue
        theta = 1.0 / (s.request_rate * s.burstiness)
        await asyncio.sleep(rng.gammavariate(s.burstiness, theta))


async def _wait_ready(http: Any, timeout: float) -> None:
    """Poll /health until the server answers (it may still be loading the model)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if (await http.get("/health")).status_code == 200:
                return
        except Exception:
            if time.monotonic() >= deadline:
                raise
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(0.5)


async def _scrape(http: Any) -> dict[str, float]:
    from specserve.server.metrics import parse_prometheus

    try:
        return parse_prometheus((await http.get("/metrics")).text)
    except Exception:
        return {}


def _spec_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any] | None:
    from specserve.server.metrics import sample

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    drafts, draft_tokens, accepted = (delta(n) for n in SPEC_COUNTERS)
    if drafts <= 0:
        return None
    per_pos: list[float] = []
    while (
        ver := delta("spec_decode_num_verified_tokens_per_pos_total", position=str(len(per_pos)))
    ) > 0:
        acc = delta("spec_decode_num_accepted_tokens_per_pos_total", position=str(len(per_pos)))
        per_pos.append(acc / ver)
    return {
        "num_drafts": int(drafts),
        "num_draft_tokens": int(draft_tokens),
        "num_accepted_tokens": int(accepted),
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_acceptance_length": 1.0 + accepted / drafts,
        "acceptance_per_position": per_pos,
    }


def _stats(xs: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    """mean / median / std / pN in milliseconds."""
    if not xs:
        return {}
    ms = sorted(x * 1000 for x in xs)
    out = {"mean": statistics.fmean(ms), "median": statistics.median(ms)}
    out["std"] = statistics.pstdev(ms)
    for p in percentiles:  # linear interpolation, as numpy.percentile (and vLLM) do
        pos = p / 100 * (len(ms) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(ms) - 1)
        out[f"p{p:g}"] = ms[lo] + (ms[hi] - ms[lo]) * (pos - lo)
    return out


def summarize(
    s: ServeBenchSettings, results: list[RequestResult], duration: float, spec: dict | None
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tok / duration if duration else 0.0,
        "total_token_throughput": (in_tok + out_tok) / duration if duration else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok], s.percentiles),
        "tpot_ms": _stats([r.tpot for r in ok if r.tpot is not None], s.percentiles),
        "itl_ms": _stats([g for r in ok for g in r.itl], s.percentiles),
        "e2el_ms": _stats([r.e2e for r in ok], s.percentiles),
        "speculation": spec,
    }


async def run_serve_bench_async(s: ServeBenchSettings) -> dict[str, Any]:
    import httpx

    requests = build_requests(s)
    headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
    limits = httpx.Limits(max_connections=s.max_concurrency or len(requests) or 1)
    timeout = httpx.Timeout(None, connect=30.0)
    async with httpx.AsyncClient(
        base_url=s.base_url, headers=headers, limits=limits, timeout=timeout
    ) as http:
        await _wait_ready(http, s.ready_timeout)
        model = s.model
        if model is None:
            resp = await http.get("/v1/models")
            resp.raise_for_status()
            model = resp.json()["data"][0]["id"]
        sem = asyncio.Semaphore(s.max_concurrency) if s.max_concurrency else None
        before = await _scrape(http)
        t0 = time.perf_counter()

        async def limited(req: BenchRequest) -> RequestResult:
            if sem is None:
                return await _one(http, s, req, model, t0)
            async with sem:
                return await _one(http, s, req, model, t0)

        tasks = [
            asyncio.create_task(limited(requests[i])) async for i in _arrivals(s, len(requests))
        ]
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        spec = _spec_delta(before, await _scrape(http))
    report = summarize(s, list(results), duration, spec)
    settings = {k: v for k, v in asdict(s).items() if k != "api_key"}
    if math.isinf(s.request_rate):
        settings["request_rate"] = "inf"  # JSON has no infinity
    report["settings"] = settings
    report["model"] = model
    report["per_request"] = [asdict(r) | {"tpot": r.tpot} for r in results]
    return report


def run_serve_bench(s: ServeBenchSettings) -> dict[str, Any]:
    report = asyncio.run(run_serve_bench_async(s))
    from specserve.bench.report import hardware_info, software_info, timestamp, write_json

    report.update(timestamp=timestamp(), hardware=hardware_info(), software=software_info())
    print(format_report(report))
    if s.json_path:
        write_json(report, s.json_path)
    if s.plot_path:
        from specserve.bench.plot_results import plot_serve_report

        plot_serve_report(report, s.plot_path)
    return report


_ROWS = (("Successful requests:", "completed", ""), ("Failed requests:", "failed", ""),
         ("Benchmark duration (s):", "duration_s", ".2f"), ("Total input tokens:", "total_input_tokens", ""),
         ("Total generated tokens:", "total_output_tokens", ""),
         ("Request throughput (req/s):", "request_throughput", ".2f"),
         ("Output token throughput (tok/s):", "output_throughput", ".2f"),
         ("Total token throughput (tok/s):", "total_token_throughput", ".2f"))  # fmt: skip
_LATENCIES = (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st)"),
              ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency"))  # fmt: skip
_SPEC_ROWS = (("Drafts:", "num_drafts", ""), ("Draft tokens:", "num_draft_tokens", ""),
              ("Accepted tokens:", "num_accepted_tokens", ""), ("Acceptance rate:", "acceptance_rate", ".3f"),
              ("Mean acceptance length:", "mean_acceptance_length", ".2f"))  # fmt: skip


def format_report(r: dict[str, Any]) -> str:
    """The table `vllm bench serve` prints, plus speculation."""
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]
    lines += [f"{name:<44}{r[key]:>16{fmt}}" for name, key, fmt in _ROWS]
    for key, title in _LATENCIES:
        lines.append("{:-^60}".format(f" {title} "))
        lines += [
            f"{(k.upper() if k[0] == 'p' else k.capitalize()) + ' (ms):':<44}{v:>16.2f}"
            for k, v in r[key].items()
        ]
    if spec := r.get("speculation"):
        lines.append("{:-^60}".format(" Speculative Decoding "))
        lines += [f"{name:<44}{spec[key]:>16{fmt}}" for name, key, fmt in _SPEC_ROWS]
        lines.append(
            "Per-position acceptance: "
            + ", ".join(f"{a:.2f}" for a in spec["acceptance_per_position"])
        )
    if r["errors"]:
        lines.append("Errors: " + "; ".join(r["errors"]))
    return "\n".join([*lines, "=" * 60])


# ------------------------------------------------------------------------------------- CLI


def add_serve_bench(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench serve` on the `bench` command's subparsers."""
    p = subparsers.add_parser(
        "serve",
        help="online benchmark against a running server (TTFT, TPOT, ITL, throughput)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server to load")
    p.add_argument("--model", default=None, help="served model name (default: the server's)")
    p.add_argument("--tokenizer", default=None, help="HF folder for ShareGPT length filtering")
    p.add_argument("--dataset", choices=("sharegpt", "random"), default="sharegpt", help="prompts")
    p.add_argument("--num-prompts", type=int, default=100, help="requests sent")
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s (default: inf)")
    p.add_argument("--burstiness", type=float, default=1.0, help="1.0 = Poisson arrivals")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--output-len", type=int, default=None, help="fixed output tokens per request")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (random dataset)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate the full length")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument(
        "--stream-granularity",
        choices=("step", "token"),
        default=None,
        help="ask the server for SSE chunks per step or per token (default: its own)",
    )
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--ready-timeout", type=float, default=0.0, help="wait this long for /health")
    p.add_argument("--seed", type=int, default=0, help="dataset and arrival seed")
    p.add_argument("--percentiles", default="50,90,99", help="comma-separated")
    p.add_argument("--json", dest="json_path", default=None, help="write the report here")
    p.add_argument("--plot", dest="plot_path", default=None, help="write a PNG here")
    p.set_defaults(func=cmd_serve_bench)
    return p


def cmd_serve_bench(args: argparse.Namespace) -> int:
    # the flags are named after the settings fields; only these two need converting
    known = {f.name for f in fields(ServeBenchSettings)}
    s = ServeBenchSettings(**{k: v for k, v in vars(args).items() if k in known})
    s.base_url = s.base_url.rstrip("/")
    s.percentiles = tuple(float(p) for p in str(args.percentiles).split(",") if p)
    report = run_serve_bench(s)
    return 0 if report["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    """Standalone entry: `python -m specserve.bench.serve --base-url ...`."""
    parser = argparse.ArgumentParser(prog="specserve bench")
    add_serve_bench(parser.add_subparsers(dest="bench_command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
