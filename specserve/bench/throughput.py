"""`specserve bench throughput`: offline throughput (or batch-1 decode speed) of specserve on a
request set, optionally against HF transformers on the same prompts in the same process."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from specserve.bench import hf_baseline
from specserve.bench.common import free_memory, memory_roofline
from specserve.bench.datasets import (
    BenchRequest,
    load_humaneval_rewrite,
    load_sharegpt,
    random_requests,
)
from specserve.bench.report import (
    RunResult,
    format_speculation,
    format_table,
    hardware_info,
    plot_report,
    ratios,
    software_info,
    timestamp,
    write_json,
)
from specserve.sampling_params import SamplingParams

DATASETS = ("sharegpt", "humaneval", "random")
# "hf": model.generate in padded batches (or one at a time with batch_1); "hf-cb": HF's
# continuous batching, model.generate_batch (the API the HF reference number used)
BASELINES = ("hf", "hf-cb")
NAME = "specserve"
# engine counters that only grow, so (after - before) isolates the timed run from the warm-up
_SPEC_COUNTERS = ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")


@dataclass
class ThroughputSettings:
    model: str | None = None
    dataset: str = "sharegpt"
    num_prompts: int = 64
    max_tokens: int = 128
    ignore_eos: bool = False
    batch_1: bool = False
    speculative_config: dict[str, Any] | None = None
    baseline: str | None = None  # None | one of BASELINES
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    # golden tokens: outputs are forced and each draft matches with this probability
    acceptance_rate: float | None = None
    enable_prefix_caching: bool = True
    hf_batch_size: int | None = None  # None: min(max_num_seqs, num_prompts)
    input_len: int = 128  # prompt length of the random dataset (the longest, with input_len_min)
    input_len_min: int | None = None  # random dataset: lengths uniform in [min, input_len]
    json_path: str | None = None
    plot_path: str | None = None
    # further LLM(...) arguments (the CLI's engine flags: tokenizer, gpu_memory_utilization, ...)
    engine_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, str):
            self.speculative_config = json.loads(self.speculative_config)
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if self.baseline is not None and self.baseline not in BASELINES:
            raise ValueError(
                f"baseline must be one of {BASELINES} or absent, got {self.baseline!r}"
            )
        if self.baseline == "hf-cb" and self.batch_1:
            # continuous batching is a throughput mode; one request at a time is --baseline hf
            raise ValueError(
                "--baseline hf-cb measures throughput: use --baseline hf with --batch-1"
            )
        if self.num_prompts < 1 or self.max_tokens < 1:
            raise ValueError("num_prompts and max_tokens must be at least 1")


def build_requests(s: ThroughputSettings, tokenizer: Any, vocab_size: int) -> list[BenchRequest]:
    # Every request gets exactly max_tokens so both sides do the same work per request (HF's
    # batched generate takes one max_new_tokens per batch).
    if s.dataset == "sharegpt":
        return load_sharegpt(s.num_prompts, tokenizer, seed=s.seed, fixed_output_len=s.max_tokens)
    if s.dataset == "humaneval":
        return load_humaneval_rewrite(
            s.num_prompts, tokenizer, seed=s.seed, output_len=s.max_tokens
        )
    return random_requests(
        s.num_prompts,
        (s.input_len_min or s.input_len, s.input_len),
        s.max_tokens,
        vocab_size,
        seed=s.seed,
    )


def _params(s: ThroughputSettings, r: BenchRequest) -> SamplingParams:
    golden = None
    if s.acceptance_rate is not None:
        # any fixed continuation will do with random weights; ids below every preset's vocab
        golden = [
            100 + (7919 * (i + 1) + len(r.prompt_token_ids)) % 40000 for i in range(r.output_len)
        ]
    return SamplingParams(
        temperature=0.0,
        max_tokens=r.output_len,
        ignore_eos=s.ignore_eos,
        seed=s.seed,
        golden_token_ids=golden,
    )


def _decode_rate(out: Any, wall: float) -> float | None:
    """Decode tok/s of one finished request: tokens after the first over the time they took."""
    n = len(out.outputs[0].token_ids)
    m = getattr(out, "metrics", None)
    first = getattr(m, "first_token_time", None)
    done = getattr(m, "finished_time", None)
    if n >= 2 and first is not None and done is not None and done > first:
        return (n - 1) / (done - first)
    return n / wall if n and wall > 0 else None  # no timestamps: fall back to the whole call


def warm_up(llm: Any, requests: Sequence[BenchRequest]) -> None:
    """One short request first: first-call costs (lazy init, allocator growth) aren't throughput.

    Its prompt is 8 tokens, under one KV block, so it leaves nothing in the prefix cache that
    a timed request could reuse (HF recomputes every prompt; a warm-up hit would be unfair)."""
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([requests[0].prompt_token_ids[:8]], warm, use_tqdm=False)


def run_specserve(llm: Any, requests: Sequence[BenchRequest], s: ThroughputSettings) -> RunResult:
    """The timed run (call warm_up first)."""
    prompts = [r.prompt_token_ids for r in requests]
    engine = getattr(llm, "engine", None)
    rates: list[float] = []
    if s.batch_1:
        outs, seconds = [], 0.0
        for p, r in zip(prompts, requests):
            t0 = time.perf_counter()
            (out,) = llm.generate([p], _params(s, r), use_tqdm=False)
            wall = time.perf_counter() - t0
            seconds += wall
            outs.append(out)
            rate = _decode_rate(out, wall)
            if rate is not None:
                rates.append(rate)
    else:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, [_params(s, r) for r in requests], use_tqdm=False)
        seconds = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = [getattr(getattr(o, "metrics", None), "num_cached_tokens", None) for o in outs]
    return RunResult(
        name=NAME,
        mode="batch1" if s.batch_1 else "batched",
        num_requests=len(requests),
        prompt_tokens=sum(len(p) for p in prompts),
        output_tokens=out_tokens,
        seconds=seconds,
        dtype=str(getattr(engine, "dtype", s.dtype)).removeprefix("torch."),
        device=str(getattr(engine, "device", s.device)),
        batch_size=1 if s.batch_1 else s.max_num_seqs,
        per_request_decode_tok_s=rates,
        cached_prompt_tokens=None if None in cached else sum(cached),
    )


def _metrics(llm: Any) -> dict[str, Any]:
    get = getattr(llm, "get_metrics", None)
    return dict(get()) if callable(get) else {}


def speculation_summary(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """Speculation numbers of the timed run; None when the engine drafted nothing."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in _SPEC_COUNTERS if k in after}
    if not d.get("spec_drafts"):
        return None
    out: dict[str, Any] = dict(d)
    if d.get("spec_draft_tokens"):
        out["acceptance_rate"] = d["spec_accepted_tokens"] / d["spec_draft_tokens"]
    # tokens emitted per verify step of a drafting request: accepted drafts + the sampled one
    out["mean_acceptance_length"] = 1 + d.get("spec_accepted_tokens", 0) / d["spec_drafts"]
    # engine-lifetime values (include the warm-up request, which drafts little if at all)
    for k in ("spec_acceptance_per_position", "spec_mean_acceptance_length"):
        if k in after:
            out[f"engine_{k}"] = after[k]
    return out


def _baseline_model_path(s: ThroughputSettings, llm: Any) -> str:
    if s.model:
        return s.model
    try:
        from specserve.model.loader.default_model import default_model_path

        return str(default_model_path())
    except ImportError:
        return str(llm.model_name)


def engine_hf_config(llm: Any) -> Any | None:
    """An HF config of the engine's model (what a `dummy:` baseline is built from), or None."""
    mc = getattr(getattr(llm, "engine", None), "model_config", None)
    if mc is None:
        return None
    try:
        return hf_baseline.hf_config_from_model_config(mc)
    except (AttributeError, TypeError, ValueError):
        return None  # an engine config of another shape: only dummy: baselines need it


def _vocab_size(llm: Any) -> int:
    cfg = engine_hf_config(llm)
    size = getattr(cfg, "vocab_size", None)
    return int(size) if size else len(llm.tokenizer)


def make_llm(s: ThroughputSettings) -> Any:
    from specserve import LLM

    spec = s.speculative_config
    if s.acceptance_rate is not None:
        k = (spec or {}).get("num_speculative_tokens", 4)
        spec = {
            "method": "golden",
            "num_speculative_tokens": k,
            "acceptance_rate": s.acceptance_rate,
        }
        spec["verify_budget"] = (s.speculative_config or {}).get("verify_budget", "off")
    kwargs: dict[str, Any] = dict(
        model=s.model,
        speculative_config=spec,
        dtype=s.dtype,
        device=s.device,
        max_num_seqs=s.max_num_seqs,
        seed=s.seed,
    )
    # only pass what was set, so the engine's own defaults apply otherwise
    if s.max_model_len is not None:
        kwargs["max_model_len"] = s.max_model_len
    if s.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = s.max_num_batched_tokens
    if not s.enable_prefix_caching:
        kwargs["enable_prefix_caching"] = False
    if s.enforce_eager:
        kwargs["enforce_eager"] = True
    kwargs.update(s.engine_args)
    return LLM(**kwargs)


def _continuous_line(base: RunResult) -> str:
    """What generate_batch chose on its own (attention, sizes), and the setup kept out of the
    timed run: the numbers a reader needs to trust an hf-cb ratio."""
    d = base.to_dict()
    setup = d.get("setup_seconds")
    return (
        f"{base.name}: transformers generate_batch (continuous batching), attention "
        f"{d.get('attn_implementation')}, max_batch_tokens {d.get('max_batch_tokens')}, "
        f"num_blocks {d.get('num_blocks')}, max_requests_per_batch "
        f"{d.get('max_requests_per_batch')}"
        + (f"; setup + warm-up {setup:.2f} s, not in the timed run" if setup is not None else "")
    )


def run_throughput(
    s: ThroughputSettings, llm: Any | None = None, verbose: bool = True
) -> dict[str, Any]:
    """Run the benchmark and return the report dict (also written to s.json_path / s.plot_path).

    Pass `llm` to reuse an engine (it is left alive); otherwise one is built from the settings
    and freed before the baseline loads, so the two never share device memory.
    """
    own = llm is None
    if llm is None:
        llm = make_llm(s)
    tokenizer = llm.tokenizer
    model_name = str(getattr(llm, "model_name", s.model))
    hf_config = engine_hf_config(llm)
    eos_ids = getattr(getattr(llm, "engine", None), "eos_ids", None)
    requests = build_requests(s, tokenizer, _vocab_size(llm))
    warm_up(llm, requests)
    before = _metrics(llm)
    ours = run_specserve(llm, requests, s)
    after = _metrics(llm)
    spec = speculation_summary(before, after)
    roofline = (
        memory_roofline(llm, ours.median_decode_tok_s)
        if s.batch_1 and ours.median_decode_tok_s
        else None
    )
    baseline_path = _baseline_model_path(s, llm) if s.baseline else None
    if own:
        del llm
        free_memory()
    base: RunResult | None = None
    if s.baseline in BASELINES:
        assert baseline_path is not None
        base = hf_baseline.run_hf_baseline(
            baseline_path,
            requests,
            ignore_eos=s.ignore_eos,
            batch_1=s.batch_1,
            batch_size=s.hf_batch_size or min(s.max_num_seqs, len(requests)),
            dtype=s.dtype,
            device=s.device,
            tokenizer=tokenizer,
            hf_config=hf_config,
            eos_token_ids=sorted(eos_ids) if eos_ids else None,
            continuous=s.baseline == "hf-cb",
        )
    report: dict[str, Any] = {
        "benchmark": "throughput",
        "timestamp": timestamp(),
        "model": model_name,
        "settings": asdict(s),
        "hardware": hardware_info(),
        "software": software_info(),
        "specserve": ours.to_dict(),
        "baseline": base.to_dict() if base else None,
        "ratio": ratios(ours, base) if base else None,
        "speculation": spec,
        "engine_metrics": after,
        "memory_roofline": roofline,
    }
    if verbose:
        sides = [ours] + ([base] if base else [])
        print(format_table(sides, base))
        if base is not None and base.mode == "continuous":
            print(_continuous_line(base))
        if ours.cached_prompt_tokens:
            print(
                f"{ours.name}: {ours.cached_prompt_tokens} of {ours.prompt_tokens} prompt tokens "
                "came from the prefix cache (--no-prefix-caching to turn it off)"
            )
        for side in sides if s.batch_1 else []:
            rates = ", ".join(f"{r:.1f}" for r in side.per_request_decode_tok_s)
            print(f"{side.name} decode tok/s per request: [{rates}]")
        if roofline:
            print(
                f"memory roofline: {roofline['weight_bytes'] / 1e9:.2f} GB of weights at "
                f"{roofline['copy_bandwidth_bytes_s'] / 1e12:.2f} TB/s copy bandwidth = "
                f"{roofline['roofline_tok_s']:.1f} tok/s; decode at "
                f"{100 * roofline['fraction_of_roofline']:.1f} % of it"
            )
        if spec:
            print(format_speculation(spec))
        elif s.speculative_config:
            print("speculation: configured, but the engine reported no drafts in this run")
    if s.json_path:
        write_json(report, s.json_path)
    if s.plot_path:
        sides = [ours] + ([base] if base else [])
        title = f"{model_name} | {s.dataset} x{s.num_prompts} | max_tokens={s.max_tokens}"
        plot_report(sides, s.plot_path, title=title)
    return report
