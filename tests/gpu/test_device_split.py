"""The device split (specserve.runner.device_split): the host fixes a step's total rows, the
device shares them among its requests by the confidences the step in flight wrote.

Unmarked: the stage's layout of any per-request inputs is the host's layout (graphs.prepare) of
the draft counts it chose, and those counts are split_rows of the newest survivals; a whole CPU
engine (golden drafts on the device, overlap, the verify budget, a fake graph backend) emits
the tokens of the same engine with the split off and of no speculation. `gpu`: the same engine
on CUDA with real graphs, and the stage replayed in a CUDA graph.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve import LLM, SamplingParams, env
from specserve.runner.cuda_graph import DecodeGraphs
from specserve.runner.device_split import SplitRows, lay_out_split, split_rows
from specserve.speculative.verify_budget import VerifyBudget
from tests.gpu.conftest import steps_without_host_sync
from tests.speculative.conftest import curve_of
from tests.speculative.fake_graphs import FakeGraphs

BS, SLOTS, MAX_SEQS = 4, 6, 4


def _graphs(k: int) -> DecodeGraphs:
    """Bucket layouts on the CPU (no model: only prepare and prepare_split run)."""
    z = torch.zeros(SLOTS + 1, dtype=torch.int64)
    return DecodeGraphs(
        None, [], BS, MAX_SEQS, 1 + k, 40, torch.device("cpu"), 8, torch.float32, z,
        torch.full(((SLOTS + 1) * k,), -1), z,
    )  # fmt: skip


def _device_views(graphs: DecodeGraphs, step):
    buf = torch.from_numpy(step.packed.copy())
    lay = step.bucket.layout
    fwd = lay.split(buf, torch.int64, torch.int32)
    return SplitRows(*fwd), lay.split_tail(buf, torch.int64, torch.float32)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_the_split_lays_out_what_the_host_would_for_the_counts_it_chose(data):
    k = data.draw(st.integers(1, 4))
    n = data.draw(st.integers(1, MAX_SEQS))
    g = _graphs(k)
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    slots = rng.sample(range(1, SLOTS + 1), n)
    starts = [rng.randrange(0, 24) for _ in range(n)]
    room = [rng.randrange(0, k + 1) for _ in range(n)]
    tables = [rng.sample(range(1, 40), (s + r) // BS + 1) for s, r in zip(starts, room)]
    pending = [s if rng.random() < 0.5 else 0 for s in slots]
    anchors = [0 if p else rng.randrange(3, 99) for p in pending]
    shifted = [rng.random() < 0.5 for _ in range(n)]
    total = data.draw(st.integers(n, n + sum(room)))
    draft_ids = torch.randint(3, 99, (SLOTS + 1, k))
    draft_ids[torch.rand(SLOTS + 1, k) < 0.2] = -1
    draft_conf = torch.rand(SLOTS + 1, k)
    draft_conf[torch.rand(SLOTS + 1, k) < 0.2] = 0.5  # ties
    seed = [rng.randrange(1, 1000) for _ in range(n)]
    n_out = [rng.randrange(0, 50) for _ in range(n)]
    temp = [rng.choice([0.0, 0.5]) for _ in range(n)]  # exact in float32

    step = g.prepare_split(anchors, pending, tables, total)
    assert step is not None and step.split and step.num_rows == total
    tv = step.tail_views()
    tv.slots[:n], tv.room[:n], tv.anchor_pos[:n] = slots, room, starts
    tv.req_shift[:n] = [s if sh else 0 for s, sh in zip(slots, shifted)]
    tv.seed[:n], tv.counter[:n], tv.temperature[:n] = seed, n_out, temp
    fwd, tail = _device_views(g, step)
    bt = torch.zeros(step.bucket.layout.reqs, g.width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    got = lay_out_split(fwd, tail, bt, BS, draft_ids, draft_conf).tolist()
    tb = step.bucket.rows

    # the counts: the Tb - n largest newest survivals, within each request's room and drafts
    conf = draft_conf[slots] * (draft_ids[slots] >= 0)
    conf = torch.where(torch.arange(k)[None, :] < torch.tensor(room)[:, None], conf, 0.0)
    want = split_rows(conf.cumprod(1), tb - n).tolist()
    assert got[:n] == want and not any(got[n:])
    assert all(c <= r for c, r in zip(got, room))

    # the rows: the host's layout of those counts (padding past its rows, as prepare pads)
    rows = [[a] + [0] * c for a, c in zip(anchors, got)]
    t = sum(map(len, rows))
    pend, at, sh = np.zeros(t, np.int64), np.zeros(t, np.int64), np.zeros(t, np.int64)
    off = 0
    for i, c in enumerate(got[:n]):
        pend[off] = pending[i]
        at[off + 1 : off + 1 + c] = np.arange(1, c + 1) + slots[i] * k
        sh[off : off + 1 + c] = slots[i] if shifted[i] else 0
        off += 1 + c
    ref = g.prepare(rows, starts, tables, pend, at, sh)
    r_ids, r_pos, r_slots, r_pend, r_at, r_sh, r_req, r_q, r_cu, r_ctx = ref.bucket.layout.split(
        ref.packed, np.int64, np.int32
    )
    for dev, host in zip(fwd[:7], (r_ids, r_pos, r_slots, r_pend, r_at, r_sh, r_req)):
        assert dev[:t].tolist() == host[:t].tolist()
    assert fwd.slots[t:].eq(-1).all() and not fwd.ids[t:].any() and not fwd.row_req[t:].any()
    assert not (fwd.pending[t:].any() or fwd.draft_at[t:].any() or fwd.shift[t:].any())
    assert fwd.query_lens[:n].tolist() == r_q[:n].tolist() and not fwd.query_lens[n:].any()
    assert fwd.cu_query_lens.tolist() == [0] + [
        t if i >= n else int(r_cu[i + 1]) for i in range(len(fwd.query_lens))
    ]
    assert fwd.context_lens[:n].tolist() == r_ctx[:n].tolist() and not fwd.context_lens[n:].any()

    # the tail's per-row inputs: each request's, and its output index + the row's step
    sq = [1 + c for c in got[:n]]
    ftp = np.cumsum(sq) - sq
    assert tail.seqlens_q.tolist() == sq + [0] * (len(tail.seqlens_q) - n)
    assert tail.ftp.tolist() == ftp.tolist() + [t] * (len(tail.ftp) - n)
    req = np.repeat(np.arange(n), sq)
    local = np.arange(t) - ftp[req]
    assert tail.seed.tolist() == [seed[i] for i in req] + [0] * (tb - t)
    assert tail.counter.tolist() == [n_out[i] + j for i, j in zip(req, local)] + [0] * (tb - t)
    assert tail.temperature.tolist() == [temp[i] for i in req] + [0.0] * (tb - t)
    assert not tail.draft.any()


GOLDEN = {"method": "golden", "num_speculative_tokens": 3, "acceptance_rate": 0.7}
GOLD = random.Random(0).choices(range(3, 49000), k=60)


def _engine(split: bool | None, device: str) -> LLM:
    """Golden drafts on the device with overlap; the budget prices a step of up to 8 rows at 1
    and more at 3, so at 4 requests it keeps 4 of their 12 drafts (split: which 4, the device
    decides). None: no speculation."""
    cuda = device == "cuda"
    with env.override(graph_tail=True):
        llm = LLM("dummy:tiny", device=device, dtype="float32",
                  speculative_config=GOLDEN if split is not None else None, max_num_seqs=4,
                  max_model_len=256, kv_cache_memory_gb=0.05, overlap=True,
                  enforce_eager=not cuda, debug_invariants=True, progress=False)  # fmt: skip
        eng = llm.engine
        if split is None:
            return llm
        eng._worker = None  # the launcher runs the device part inline, as on CUDA
        if not cuda:
            eng.runner.init_cuda_graphs(
                4, 4, 256, progress=False, backend=FakeGraphs(),
                drafting=eng.device_drafting.tail_drafting(),
            )  # fmt: skip
        curve = curve_of([1, 2, 4, 8, 16, 24, 32], lambda b: 1.0 if b <= 8 else 3.0, padded=True)
        eng.budget = VerifyBudget(curve, eng.max_num_batched_tokens)
        eng.budget.observe_step = lambda *a, **kw: None  # the prices stay the test's
    return llm


def _split_matches_host_split(device: str) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 17, 9, 30, 12, 7)]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=20 + 5 * i,
            ignore_eos=True,
            golden_token_ids=GOLD[: 10 + 8 * i] if i != 2 else None,
            stop_token_ids=[GOLD[25]] if i == 3 else None,
        )  # fmt: skip
        for i in range(6)
    ]

    def run(llm: LLM, split: bool) -> list:
        with env.override(device_split=split):
            outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]

    want = run(_engine(None, device), False)
    host = _engine(False, device)
    assert run(host, False) == want
    assert host.engine.runner.graphs.num_split_runs == 0
    llm = _engine(True, device)
    assert run(llm, True) == want
    eng = llm.engine
    assert eng.runner.graphs.num_split_runs > 0 and eng.num_sync_steps <= 1
    assert eng.ledger.spec.num_accepted_tokens > 0
    assert eng.block_manager.num_used_blocks == 0 and eng.slot_pool.num_in_use == 0
    assert eng.slot_pool.rejected[0].item() == 0


def test_a_device_split_engine_emits_the_tokens_of_no_speculation_cpu() -> None:
    _split_matches_host_split("cpu")


@pytest.mark.gpu
def test_a_device_split_engine_emits_the_tokens_of_no_speculation_cuda(cuda) -> None:
    if cuda.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    _split_matches_host_split("cuda")


@pytest.mark.gpu
def test_no_host_sync_inside_a_device_split_step(cuda) -> None:
    """Under torch.cuda.set_sync_debug_mode("error") any synchronising call in a step raises
    (the wait for the step in flight lifts it for itself only): split steps lay their rows out
    and read back without one."""
    if cuda.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    llm = _engine(True, "cuda")
    eng = llm.engine
    prompts = [[7 + i] * (5 + 3 * i) for i in range(4)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, golden_token_ids=GOLD)
        for _ in prompts
    ]
    with env.override(device_split=True):
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        before = eng.runner.graphs.num_split_runs
        steps_without_host_sync(eng, prompts, params)
    assert eng.runner.graphs.num_split_runs > before
