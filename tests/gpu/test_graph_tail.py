"""The sampling tail inside a bucket's CUDA graph (specserve.runner.graph_tail).

Unmarked: a whole CPU engine whose decode/verify steps take the bucket layout through a fake
graph backend (sample.verify.verify_padded's torch branch), against the same engine with the
tail off (the eager sampler after the forward) and against no graphs at all: the same tokens,
greedy and seeded temperature, with host drafts of n-gram speculation, and the tail taken only
by the steps of the common shape. `gpu`: the same on CUDA with real graphs (the Triton pass).
Device drafting (overlap, golden drafts written in the tail and read by the next step; n-gram's
steps sample eagerly): the tokens and speculation counters of the eager sampler, CPU and CUDA.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve import LLM, SamplingParams, env
from specserve.runner.bucket_layout import BucketLayout
from specserve.runner.graph_tail import TailViews
from specserve.sample.verify import verify_padded
from tests.speculative.fake_graphs import FakeGraphs

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "verify_budget": "off"}


def _engine(device: str, spec: dict | None, graphs: str, seed: int = 0) -> LLM:
    """graphs: "none" (CPU eager path), "tail" or "eager-sampler" (bucket layout, tail off)."""
    cuda = device == "cuda"
    # host drafts (device drafters never take the tail): n-gram's synchronous steps verify
    with env.override(graph_tail=graphs == "tail", device_drafts=False):
        llm = LLM(
            "dummy:tiny",
            device=device,
            dtype="float32",
            speculative_config=spec,
            max_num_seqs=4,
            max_model_len=256,
            kv_cache_memory_gb=0.05,
            enforce_eager=not cuda,
            overlap=False if not cuda else None,
            seed=seed,
            progress=False,
        )
        if not cuda and graphs != "none":
            k = spec["num_speculative_tokens"] if spec else 0
            llm.engine.runner.init_cuda_graphs(4, 1 + k, 256, progress=False, backend=FakeGraphs())
    return llm


def _run(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 17, 9, 30, 12)]
    prompts.append([11, 12, 13, 14] * 6)  # repeats: n-gram drafts from the start
    outs = llm.generate(prompts, params[: len(prompts)], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _params(kind: str) -> list[SamplingParams]:
    if kind == "greedy":
        return [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 6
    if kind == "temperature":
        return [
            SamplingParams(max_tokens=24, temperature=(0.05, 0.8)[i % 2], seed=i, ignore_eos=True)
            for i in range(6)
        ]
    # mixed: top-p and logprobs requests keep their steps on the eager sampler
    return [
        SamplingParams(max_tokens=24, temperature=0.7, seed=1, ignore_eos=True, top_p=0.9),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
        *[SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 4,
    ]


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram3"])
@pytest.mark.parametrize("kind", ["greedy", "temperature", "mixed"])
def test_tail_emits_what_the_eager_sampler_does_cpu(spec: dict | None, kind: str) -> None:
    want = _run(_engine("cpu", spec, "none"), _params(kind))
    eager_sampler = _engine("cpu", spec, "eager-sampler")
    assert _run(eager_sampler, _params(kind)) == want
    assert eager_sampler.engine.runner.graphs.num_tail_runs == 0
    tail = _engine("cpu", spec, "tail")
    assert _run(tail, _params(kind)) == want
    g = tail.engine.runner.graphs
    assert g.num_tail_runs > 0
    if kind == "mixed":  # the steps holding the top-p or logprobs request sampled eagerly
        assert g.num_tail_runs < g.num_replays
    if spec is not None:
        assert g.num_verify_replays > 0 and tail.engine.ledger.spec.num_accepted_tokens > 0


def test_padded_verify_ignores_padding_rows_and_requests() -> None:
    """Rows past T and requests past R change nothing of the real ones: the tail's verify of a
    bucket against the same step laid out exactly."""
    rng = np.random.default_rng(0)
    lay = BucketLayout(16, 8, 4)
    buf = torch.zeros(lay.max_bytes, dtype=torch.uint8)
    views = lay.split_tail(buf, torch.int64, torch.float32)
    assert isinstance(views, TailViews) and views.seed.shape == (16,) and views.slots.shape == (8,)
    seqlens = [3, 1, 4]  # T = 8 of 16 rows, R = 3 of 8 requests
    t, r = sum(seqlens), len(seqlens)
    logits = torch.tensor(rng.normal(size=(16, 11)), dtype=torch.float32)
    target = logits.argmax(1)
    draft = target.clone()
    draft[1] = (draft[1] + 1) % 11  # request 0 rejects its second draft; request 2 takes all
    temp = torch.zeros(16)
    ftp = torch.tensor([0, 3, 4] + [t] * 5)
    sq = torch.tensor(seqlens + [0] * 5)
    res = verify_padded(logits, draft, temp, torch.zeros(16, dtype=torch.int64),
                        torch.zeros(16, dtype=torch.int64), sq, ftp)  # fmt: skip
    assert res.num_accepted[:r].tolist() == [1, 0, 3]
    assert res.sampled_token_ids[:r].tolist() == [
        target[1].item(),
        target[3].item(),
        target[7].item(),
    ]
    assert res.verified_token_ids[:t].tolist() == [draft[0].item(), -1, -1, -1,
                                                   *draft[4:7].tolist(), -1]  # fmt: skip
    assert res.num_accepted[r:].tolist() == [0] * 5


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram3"])
@pytest.mark.parametrize("kind", ["greedy", "temperature", "mixed"])
def test_tail_emits_what_the_eager_sampler_does_cuda(
    cuda: torch.device, spec: dict | None, kind: str
) -> None:
    if cuda.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    want = _run(_engine("cuda", spec, "eager-sampler"), _params(kind))
    tail = _engine("cuda", spec, "tail")
    assert _run(tail, _params(kind)) == want
    g = tail.engine.runner.graphs
    assert g.num_tail_runs > 0 and g.num_eager_runs == 0


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 600), reqs=st.integers(1, 256), width=st.integers(1, 70))
def test_layout_sections_are_disjoint_and_aligned(rows: int, reqs: int, width: int) -> None:
    """The tail's inputs, the forward's and the block tables tile the bucket's upload without
    overlap, each view aligned to its dtype and of its documented length."""
    lay = BucketLayout(rows, reqs, width)
    buf = np.zeros(lay.max_bytes, dtype=np.uint8)
    base = buf.ctypes.data
    spans = []
    for v in (*lay.split_tail(buf, np.int64, np.float32), *lay.split(buf, np.int64, np.int32)):
        start = v.ctypes.data - base
        assert start % v.itemsize == 0
        spans.append((start, start + v.nbytes))
    spans.append((lay.bt_at, lay.max_bytes))  # the compact block tables
    spans.sort()
    assert spans[0][0] == 0 and spans[-1][1] == lay.max_bytes
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    tail = lay.split_tail(buf, np.int64, np.float32)
    assert [len(x) for x in tail] == [rows] * 3 + [reqs] * 7 + [rows]
    assert lay.fwd_at % 8 == 0 and tail.temperature.ctypes.data - base < lay.fwd_at


GOLD = random.Random(0).choices(range(3, 49000), k=40)


DEVICE_DRAFTERS = {
    "golden": {"method": "golden", "num_speculative_tokens": 3, "acceptance_rate": 0.7},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
}
TAIL_DRAFTERS = ("golden",)  # n-gram's steps sample eagerly (DeviceDrafting.tail_drafting)


def _drafting_engine(method: str, graphs: str, device: str = "cpu") -> LLM:
    """An engine drafting on the device with overlap: graphs "none", "tail" (device-drafted
    steps sample in the tail) or "eager-sampler". On the CPU its forward runs inline (no worker
    thread, as on CUDA) so its steps may take the bucket layout."""
    # fixed k: the drafts verified do not depend on timings
    spec = DEVICE_DRAFTERS[method] | {"verify_budget": "off"}
    cuda = device == "cuda"
    with env.override(graph_tail=graphs == "tail"):
        llm = LLM("dummy:tiny", device=device, dtype="float32", speculative_config=spec,
                  max_num_seqs=4, max_model_len=256, kv_cache_memory_gb=0.05, overlap=True,
                  enforce_eager=not cuda, debug_invariants=True, progress=False)  # fmt: skip
        eng = llm.engine
        eng._worker = None  # the launcher runs the device part inline
        if graphs != "none" and not cuda:
            eng.runner.init_cuda_graphs(
                4, 4, 256, progress=False, backend=FakeGraphs(),
                drafting=eng.device_drafting.tail_drafting(),
            )  # fmt: skip
    return llm


def _drafting_params(temperature: float) -> list[SamplingParams]:
    """Golden ids on most requests (some past them, some without), a stop token inside them,
    one min_tokens request (its steps sample eagerly), seeds for the sampled runs. (n-gram:
    golden requests sample eagerly, the others in the tail.)"""
    return [
        SamplingParams(
            temperature=temperature,
            seed=i,
            max_tokens=20 + 3 * i,
            ignore_eos=True,
            golden_token_ids=GOLD[: 12 + 6 * i] if i != 2 else None,
            min_tokens=4 if i == 4 else 0,
            stop_token_ids=[GOLD[25]] if i == 3 else None,
        )  # fmt: skip
        for i in range(6)
    ]


def _drafted_tail_matches_eager(method: str, device: str, temperature: float) -> None:
    """Drafts written in the tail, read by the next overlapped step: the tokens, the drafts
    verified and accepted per position, and the finish reasons of the eager sampler."""
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 17, 9, 30, 12)]
    prompts.append([11, 12, 13, 14] * 6)  # repeats: n-gram drafts from the start
    params = _drafting_params(temperature)
    if method == "ngram":  # golden ids on the shortest request only: later steps take the tail
        params = [params[0], *(dataclasses.replace(p, golden_token_ids=None) for p in params[1:])]

    def run(llm: LLM) -> list:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]

    eager = _drafting_engine(method, "eager-sampler", device)
    want = run(eager)
    assert eager.engine.runner.graphs.num_drafted_tail_runs == 0
    if device == "cpu":  # and the eager path's own layout
        none = _drafting_engine(method, "none")
        assert run(none) == want and none.engine.ledger.spec == eager.engine.ledger.spec
    tail = _drafting_engine(method, "tail", device)
    assert run(tail) == want
    eng = tail.engine
    g = eng.runner.graphs
    assert (g.num_drafted_tail_runs > 0) == (method in TAIL_DRAFTERS) and g.num_verify_replays > 0
    assert eng.num_sync_steps <= 1  # overlapped all along (only the first step)
    assert eng.ledger.spec == eager.engine.ledger.spec
    assert eng.ledger.spec.num_accepted_tokens > 0
    assert eng.block_manager.num_used_blocks == 0 and eng.slot_pool.num_in_use == 0
    assert eng.slot_pool.rejected[0].item() == 0  # padding requests left slot 0 alone


@pytest.mark.parametrize("method", list(DEVICE_DRAFTERS))
@pytest.mark.parametrize("temperature", [0.0, 0.05])  # 0.05: n-gram drafts still match
def test_device_drafted_steps_sample_in_the_tail_as_the_eager_sampler_does_cpu(
    method: str, temperature: float
) -> None:
    _drafted_tail_matches_eager(method, "cpu", temperature)


@pytest.mark.gpu
@pytest.mark.parametrize("method", list(DEVICE_DRAFTERS))
@pytest.mark.parametrize("temperature", [0.0, 0.05])  # 0.05: n-gram drafts still match
def test_device_drafted_steps_sample_in_the_tail_as_the_eager_sampler_does_cuda(
    cuda: torch.device, method: str, temperature: float
) -> None:
    if cuda.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    _drafted_tail_matches_eager(method, "cuda", temperature)
