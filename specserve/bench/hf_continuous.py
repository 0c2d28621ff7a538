"""HF transformers' continuous batching (`model.generate_batch`) as a throughput baseline
(`specserve bench throughput --baseline hf-cb`).

The issue's HF reference number was measured with this API, so the same-run comparison has to
use it too: `hf_baseline.run_hf_batched` (left-padded static batches of `model.generate`) is a
different and slower HF path. Checked against transformers 5.17 and 5.24, whose generate_batch,
add_request(s), eos handling and workload hints are the same.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specserve.bench.datasets import BenchRequest
from specserve.bench.hf_baseline import _count_output, _eos_ids, _sync
from specserve.bench.report import RunResult

NAME = "hf-cb"
MODE = "continuous"
# The warm-up prompt is this many tokens of the first request: under one KV page (256 tokens in
# both versions), so it leaves no complete block in HF's prefix cache for a timed request to hit.
_WARM_PROMPT_TOKENS = 8


@dataclass
class ContinuousRunResult(RunResult):
    """A RunResult plus what generate_batch chose on its own, so the JSON says what was measured."""

    # the attention generate_batch ran with: 5.17 names it "paged|sdpa", 5.24 "sdpa"; both swap
    # sdpa/eager for flash attention when a flash package is installed
    attn_implementation: str | None = None
    max_batch_tokens: int | None = None  # tokens per forward, inferred from free memory by default
    num_blocks: int | None = None  # KV-cache blocks, inferred from free memory by default
    max_requests_per_batch: int | None = None
    # manager setup (cache allocation, CUDA-graph capture) and the warm-up request: paid once,
    # outside `seconds`, as the engine's own start-up is outside its timed run
    setup_seconds: float | None = None


def cb_generation_config(model: Any, max_new: int, ignore_eos: bool, eos: set[int]) -> Any:
    """Greedy GenerationConfig for generate_batch, stopping on exactly the ids `_count_output` uses.

    generate_batch has no min_new_tokens-style ignore_eos: a request stops on any id in its eos
    set, and RequestState keeps only ids >= 0, so -1 gives an empty set (the value HF itself
    uses for "no EOS"). Not None: init_continuous_batching rewrites None to -1 with a warning
    (into the config it was given), and add_request(s) alone would fall back to model.config's.
    """
    gc = copy.deepcopy(model.generation_config)
    # the same knobs the other modes neutralise (a checkpoint's sampling defaults)
    gc.do_sample = False
    gc.temperature = None
    gc.top_p = None
    gc.top_k = None
    gc.max_new_tokens = max_new
    gc.eos_token_id = -1 if ignore_eos or not eos else sorted(eos)
    return gc


def cb_config(max_batch_tokens: int | None = None, num_blocks: int | None = None) -> Any:
    """A ContinuousBatchingConfig with HF's defaults except the two sizes, when given.

    A fresh one per call: HF resolves the remaining fields in place when a manager is built.
    """
    from transformers import ContinuousBatchingConfig

    kw: dict[str, int] = {}
    if max_batch_tokens is not None:
        kw["max_batch_tokens"] = max_batch_tokens
    if num_blocks is not None:
        kw["num_blocks"] = num_blocks
    return ContinuousBatchingConfig(**kw)


def generate_batch_tokens(
    model: Any, prompts: Sequence[Sequence[int]], max_new: int, gen_config: Any, cb: Any
) -> list[list[int]]:
    """Generated ids per prompt, in prompt order, from one `model.generate_batch` call.

    Not under torch.inference_mode (generate_batch is no_grad already): the manager's warm-up
    allocates the KV cache in the calling thread, and in 5.17 the generation thread runs under
    no_grad only, so a cache made of inference tensors fails its first in-place update there
    ("Inplace update to inference tensor outside InferenceMode"; seen on CPU with 5.17). 5.24
    copies the caller's mode into the thread.
    """
    outs = model.generate_batch(
        [list(p) for p in prompts],
        generation_config=gen_config,
        continuous_batching_config=cb,
        max_new_tokens=max_new,  # the only per-call length generate_batch takes
        progress_bar=False,
    )
    # generate_batch logs (not raises) lost or failed requests; a throughput number over a
    # partial run would be wrong, so stop here
    failed = [rid for rid, o in outs.items() if o.error is not None]
    if len(outs) != len(prompts) or failed:
        raise RuntimeError(
            f"generate_batch returned {len(outs)} of {len(prompts)} requests, failed: {failed}"
        )
    return [list(o.generated_tokens) for o in outs.values()]  # in input order (HF reorders)


def _warm_up(
    model: Any, prompt: Sequence[int], gen_config: Any, cb: Any, hints: Any
) -> dict[str, Any]:
    """Build the manager the timed generate_batch call will reuse, and run one short request.

    The manager is sized from workload hints (requests per batch, blocks per request), so it is
    built here with the timed run's hints: the ones generate_batch would compute itself. Kept on
    the model (persistent_manager), it spares the timed call the cache allocation and graph
    capture. Returns the attention and sizes the manager resolved.
    """
    with model.continuous_batching_context_manager(
        generation_config=gen_config,
        continuous_batching_config=cb,
        block=True,
        timeout=5,  # what generate_batch passes
        persistent_manager=True,
        warmup=True,
        workload_hints=hints,
    ) as manager:
        rid = manager.add_request(list(prompt), max_new_tokens=2)
        done = [o for o in manager.request_id_iter(rid) if o.is_finished()]
        if not done or done[-1].error is not None:
            raise RuntimeError(f"generate_batch warm-up failed: {done[-1].error if done else None}")
        # read while the manager holds its attention (stop() restores the model's own)
        resolved = manager.continuous_batching_config
        return {
            "attn_implementation": model.config._attn_implementation,
            "max_batch_tokens": resolved.max_batch_tokens,
            "num_blocks": resolved.num_blocks,
            "max_requests_per_batch": resolved.max_requests_per_batch,
        }


def run_hf_continuous(
    model: Any,
    requests: Sequence[BenchRequest],
    ignore_eos: bool,
    tokenizer: Any = None,
    warmup: bool = True,
    max_batch_tokens: int | None = None,
    num_blocks: int | None = None,
) -> RunResult:
    """All requests through one `model.generate_batch` call, greedy, timed end to end.

    generate_batch takes one max_new_tokens for the whole call, so every request runs to the
    longest output_len and each is counted only up to its own (`_count_output`). `bench
    throughput` gives all requests the same output_len, so in practice nothing extra runs.

    Without `warmup` the timed call also builds its manager (cache allocation, graph capture),
    as a plain generate_batch script would measure it.
    """
    from transformers.generation.continuous_batching.utils import WorkloadHints

    device = next(model.parameters()).device
    eos = _eos_ids(model, tokenizer)
    prompts = [r.prompt_token_ids for r in requests]
    max_new = max((r.output_len for r in requests), default=1)
    gen_config = cb_generation_config(model, max_new, ignore_eos, eos)
    info: dict[str, Any] = {}
    setup_s: float | None = None
    try:
        if warmup and requests:
            hints = WorkloadHints(
                max_prompt_length=max(len(p) for p in prompts),
                max_generated_length=max_new,
                num_requests=len(prompts),
            )
            t_setup = time.perf_counter()
            warm = prompts[0][:_WARM_PROMPT_TOKENS]
            info = _warm_up(model, warm, gen_config, cb_config(max_batch_tokens, num_blocks), hints)
            _sync(device)
            setup_s = time.perf_counter() - t_setup
        _sync(device)
        t0 = time.perf_counter()
        cb = cb_config(max_batch_tokens, num_blocks)
        gens = generate_batch_tokens(model, prompts, max_new, gen_config, cb)
        _sync(device)
        seconds = time.perf_counter() - t0
    finally:
        # drop the manager kept by the warm-up (and its KV cache) even when the run failed
        model.destroy_cached_continuous_batching_manager()
    out_tokens = sum(
        _count_output(g, r.output_len, eos, ignore_eos) for g, r in zip(gens, requests)
    )
    return ContinuousRunResult(
        name=NAME,
        mode=MODE,
        num_requests=len(requests),
        prompt_tokens=sum(len(p) for p in prompts),
        output_tokens=out_tokens,
        seconds=seconds,
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        device=str(device),
        setup_seconds=setup_s,
        **info,
    )
