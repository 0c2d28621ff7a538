"""Device drafters (n-gram, golden, draft model; EAGLE-3 in test_eagle3.py) on CUDA with overlap, the default there: drafts written
inside the step into the draft slot pool and read there by the next step (launched before the
host saw them), graphs and eager alike. Greedy outputs equal speculation off, every step is
launched overlapped, and no step synchronises with the host.

    pytest -m gpu tests/gpu/test_device_drafting.py
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.model.loader.dummy import PRESETS
from tests.gpu.conftest import steps_without_host_sync

pytestmark = pytest.mark.gpu

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
GOLDEN = {"method": "golden", "num_speculative_tokens": 4, "acceptance_rate": 0.7}
SELF = {"method": "draft_model", "model": "self", "num_speculative_tokens": 3}
GOLD = [random.Random(1).randrange(3, 49152) for _ in range(60)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    root = tmp_path_factory.mktemp("devdraft")
    # head_dim 64: the Triton attention path; fp32 so graphs, eager and spec off agree exactly
    cfg = dict(PRESETS["tiny"], num_hidden_layers=4, hidden_size=256, head_dim=64)
    (root / "config.json").write_text(json.dumps(cfg))
    return f"dummy:{root}"


def _llm(model: str, spec: dict | None = None, **kw) -> LLM:
    return LLM(
        model,
        dtype="float32",
        device="cuda",
        max_num_seqs=8,
        max_model_len=256,
        kv_cache_memory_gb=0.25,
        speculative_config=spec,
        debug_invariants=True,
        progress=False,
        **kw,
    )


def _workload():
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 17, 40, 64, 9, 3, 33)]
    prompts.append([101, 102, 103, 104] * 12)  # repeats: n-gram drafts from the start
    params = [
        SamplingParams(max_tokens=40, ignore_eos=True),
        SamplingParams(max_tokens=45, ignore_eos=True, golden_token_ids=GOLD),
        SamplingParams(max_tokens=30, temperature=1.0, seed=9, ignore_eos=True),
        SamplingParams(max_tokens=60, stop_token_ids=[GOLD[25]], golden_token_ids=GOLD),
        SamplingParams(max_tokens=25, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=1, ignore_eos=True),
        SamplingParams(max_tokens=50, min_tokens=5, ignore_eos=True, golden_token_ids=GOLD),
        SamplingParams(max_tokens=48, ignore_eos=True),
    ]
    return prompts, params


def _run(llm: LLM, greedy: bool = False):
    prompts, params = _workload()
    if greedy:  # every request at temperature 0 (the workload's others sample)
        params = [dataclasses.replace(sp, temperature=0.0) for sp in params]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


@pytest.fixture(scope="module")
def ref(target):
    return _run(_llm(target))


@pytest.fixture(scope="module")
def ref_greedy(target):
    return _run(_llm(target), greedy=True)


@pytest.mark.parametrize("spec", [NGRAM, GOLDEN, SELF], ids=["ngram", "golden", "draft-model"])
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_device_drafting_matches_speculation_off(
    target, ref, ref_greedy, spec, enforce_eager
) -> None:
    llm = _llm(target, spec, enforce_eager=enforce_eager)
    eng = llm.engine
    assert eng.overlap and eng.device_drafting is not None  # the CUDA default
    # one-hot drafters keep seeded sampling identical too (the RNG counters are corrected);
    # a drafter with its own q rejects by coin flips, so only greedy outputs can be equal
    one_hot = spec["method"] in ("ngram", "golden")
    got = _run(llm, greedy=not one_hot)
    for i, (a, b) in enumerate(zip(ref if one_hot else ref_greedy, got)):
        assert a == b, f"request {i} differs with device drafting"
    assert eng.num_sync_steps == 0
    assert eng.ledger.spec.num_accepted_tokens > 0
    if not enforce_eager:
        assert eng.runner.graphs.num_verify_replays > 0  # drafts read inside the graphs
    md = eng.device_drafting.model_drafter
    if md is not None:  # the draft model's steady drafting: graphs, or their eager twin
        assert md.chain.num_steady > 0
        assert (md.chain.num_replays > 0) == (not enforce_eager)
        # prompts' catch-ups in the rows buckets' graphs (catch_up_graphs.py)
        assert (md.catch_up.num_replays > 0) == (not enforce_eager)


@pytest.mark.parametrize("spec", [NGRAM, GOLDEN, SELF], ids=["ngram", "golden", "draft-model"])
def test_no_host_sync_inside_a_speculative_step(target, spec) -> None:
    """Under torch.cuda.set_sync_debug_mode("error") any synchronising call in a step (a
    .item(), a .tolist() of a device tensor, a pageable copy) raises; the wait for the step in
    flight lifts the mode for itself only (designed_sync). Prefills, admissions (slot uploads),
    verify steps reading device drafts, stops in flight and the drain all run under it."""
    llm = _llm(target, spec)
    eng = llm.engine
    _run(llm)  # warm-up: Triton JIT, lazily built tables, allocator pools
    prompts, params = _workload()
    accepted = eng.ledger.spec.num_accepted_tokens
    assert steps_without_host_sync(eng, prompts, params) > 10
    assert eng.ledger.spec.num_accepted_tokens > accepted  # steady-state speculative steps


def _compiled_variants() -> int:
    """Triton kernels compiled so far for the verification and the draft bookkeeping."""
    from specserve.runner import triton_feed
    from specserve.sample import triton_verify

    kernels = [triton_verify._chunk_kernel, triton_verify._verify_kernel,
               triton_feed._feed_kernel, triton_feed._advance_kernel, triton_feed._golden_kernel]  # fmt: skip
    total = 0
    for k in kernels:
        caches = getattr(k, "device_caches", None)  # triton >= 3.2: device -> (cache, ...)
        if caches is not None:
            total += sum(len(c[0]) for c in caches.values())
        else:
            total += sum(len(c) for c in getattr(k, "cache", {}).values())
    return total


def test_no_triton_kernel_compiles_once_warm(target) -> None:
    """A step whose request count or row count is new compiles nothing: Triton specialises on
    ints (== 1, divisible by 16) and on pointers' 16-byte alignment, so every varying int is
    unspecialised and every per-step array aligned. A variant compiled inside a step stalls
    it for hundreds of milliseconds (and prices its bucket so in the step-cost curve)."""
    llm = _llm(target, GOLDEN)
    _run(llm)  # warm-up: every kernel's first variant
    before = _compiled_variants()
    rng = random.Random(3)
    for n in (1, 2, 3, 5, 7, 8):  # request counts of each parity, rows of every residue
        prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 40))] for _ in range(n)]
        params = [SamplingParams(max_tokens=rng.randrange(5, 30), ignore_eos=True,
                                 golden_token_ids=GOLD) for _ in range(n)]  # fmt: skip
        llm.generate(prompts, params, use_tqdm=False)
    assert _compiled_variants() == before
    assert before > 0
