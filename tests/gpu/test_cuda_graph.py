"""CUDA graphs for decode/verify steps (specserve.runner.cuda_graph).

The unmarked tests drive the bucket layout on the CPU with a fake graph backend (capture = run
once, replay = run again over the static buffers): bucket choice, padding, the block-table
scatter, eligibility, capture order. The `gpu` tests capture real graphs and check that a replay
is bit-identical to the same bucket run eagerly, and that whole engines with and without graphs
emit the same greedy tokens.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from specserve.model.loader.common import build_empty_model
from specserve.model.loader.dummy import dummy_config, init_random_
from specserve.runner.bucket_layout import capture_sizes, mixed_sizes
from specserve.runner.cuda_graph import BucketStep
from specserve.runner.model_runner import ModelRunner, StepInputs

BS = 4  # block size of the layout tests: small, so rows cross blocks


class FakeBackend:
    def capture(self, fn):
        fn()
        return fn


class EchoModel(torch.nn.Module):
    """Logit row r = what the model saw for row r: token, position, slot, the context length and
    block-table slot of its request (-7 for rows of no request)."""

    def __init__(self, vocab: int = 8) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab, hidden_size=5)
        self.ctxs: list = []

    def forward(self, ids, positions, kv_caches, ctx):
        # a snapshot: ctx holds views of static buffers that later steps overwrite
        self.ctxs.append(
            SimpleNamespace(
                **{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in vars(ctx).items()}
            )
        )
        t, b = ids.shape[0], ctx.query_lens.shape[0]
        req = torch.searchsorted(ctx.cu_query_lens[1:].long(), torch.arange(t), right=True)
        real = req < b
        r = req.clamp(max=b - 1)
        ctx_len = torch.where(real, ctx.context_lens.long()[r], -7)
        block = ctx.block_tables.long()[r, positions // BS]
        bt_slot = torch.where(real, block * BS + positions % BS, -7)
        return torch.stack([ids, positions, ctx.slot_mapping, ctx_len, bt_slot], 1).float()

    def compute_logits(self, hidden):
        pad = hidden.new_zeros(hidden.shape[0], self.config.vocab_size - hidden.shape[1])
        return torch.cat([hidden, pad], 1)


def _batch(rng: random.Random, qlens: list[int], next_block: list[int]):
    rows, starts, tables = [], [], []
    for q in qlens:
        start = rng.randrange(0, 30)
        nblocks = (start + q + BS - 1) // BS + rng.randrange(0, 2)  # sometimes a spare block
        tables.append(list(range(next_block[0], next_block[0] + nblocks)))
        next_block[0] += nblocks
        rows.append([rng.randrange(1, 1000) for _ in range(q)])
        starts.append(start)
    return rows, starts, tables


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    s = capture_sizes(64 * 4)
    assert s[:6] == [1, 2, 4, 8, 16, 24] and s[-1] == 256
    assert all(b - a == 8 for a, b in zip(s[3:], s[4:]))
    big = capture_sizes(17 * 256)
    assert big[-1] == 512 and big[big.index(256) + 1] == 272
    assert big == sorted(set(big))


def test_mixed_sizes() -> None:
    assert mixed_sizes(0) == [] and mixed_sizes(40) == [40] and mixed_sizes(100) == [64, 100]
    s = mixed_sizes(8192)
    assert s[:8] == list(range(64, 513, 64)) and s[-1] == 2048
    assert all(b - a == 128 for a, b in zip(s[7:], s[8:]))
    assert mixed_sizes(1000)[-1] == 1000 and mixed_sizes(1000) == sorted(set(mixed_sizes(1000)))


def _echo_runner(max_num_seqs: int = 4, k: int = 3, mixed: int = 0):
    model = EchoModel()
    runner = ModelRunner(model, 1, 1, 1, 64, BS, torch.float32, torch.device("cpu"))
    backend = FakeBackend()
    runner.init_cuda_graphs(
        max_num_seqs, 1 + k, 64, capture=True, progress=False, backend=backend,
        max_mixed_rows=mixed,
    )  # fmt: skip
    return runner, model


def test_capture_largest_first_all_padding() -> None:
    runner, model = _echo_runner()
    g = runner.graphs
    assert g.sizes == [1, 2, 4, 8, 16]
    seen = [(c.slot_mapping.shape[0], c.max_query_len) for c in model.ctxs]
    # largest bucket first; buckets a decode step can fill (<= 4 requests) get a second graph
    # with decode-shaped attention (max_query_len 1)
    assert seen == [(16, 4), (8, 4), (4, 4), (4, 1), (2, 2), (2, 1), (1, 1)]
    for c in model.ctxs:  # warm-up/capture: every row padding, no KV write
        assert (c.slot_mapping == -1).all() and (c.query_lens == 0).all()
        assert c.max_context_len == 64 + 4


@pytest.mark.parametrize("seed", range(6))
def test_bucket_layout(seed: int) -> None:
    rng = random.Random(seed)
    runner, model = _echo_runner()
    nb = [1]
    decodes = 0
    for i in range(5):  # consecutive steps: nothing of a larger step may leak into a smaller
        qlens = [rng.randint(1, 4) for _ in range(rng.randint(1, 4))]
        if i == 4:
            qlens = [1] * max(2, len(qlens))  # at least one decode-variant step
        rows, starts, tables = _batch(rng, qlens, nb)
        step = runner.prepare_rows(rows, starts, tables, qlens)
        assert isinstance(step, BucketStep)
        t = sum(qlens)
        assert step.bucket.rows == min(s for s in runner.graphs.sizes if s >= t)
        logits = runner.forward(step)
        assert logits.shape == (t, 8)
        ctx = model.ctxs[-1]
        tb, b = step.bucket.rows, ctx.query_lens.shape[0]
        decode = all(q == 1 for q in qlens) and 1 < tb <= 4  # the decode-shaped variant
        assert b == min(tb, 4) and ctx.max_query_len == (1 if decode else min(tb, 4))
        decodes += decode
        assert ctx.query_lens.tolist() == qlens + [0] * (b - len(qlens))
        assert ctx.cu_query_lens.tolist()[len(qlens) :] == [t] * (b + 1 - len(qlens))
        assert (ctx.slot_mapping[t:] == -1).all()
        want = []
        for row, start, table in zip(rows, starts, tables):
            for j, tok in enumerate(row):
                p = start + j
                slot = table[p // BS] * BS + p % BS
                want.append([tok, p, slot, start + len(row), slot])
        assert logits[:, :5].tolist() == want
    assert runner.graphs.num_replays == 5 and runner.graphs.num_eager_runs == 0
    assert runner.graphs.num_decode_variant_replays == decodes > 0


@pytest.mark.parametrize("graph", [True, False], ids=["bucket", "eager"])
def test_pending_rows_read_next_tokens(graph: bool) -> None:
    """Overlap scheduling: a row whose token the step in flight sampled carries its request's
    slot; the forward reads the token from runner.next_tokens on the device, in the graph (bucket
    layout) and on the eager path alike."""
    import numpy as np

    rng = random.Random(1)
    runner, _model = _echo_runner()
    if not graph:
        runner.graphs = None
    runner.next_tokens[:5] = torch.tensor([0, 701, 702, 703, 704])
    qlens = [1, 1, 1]
    rows, starts, tables = _batch(rng, qlens, [1])
    pending = np.array([3, 0, 1], dtype=np.int64)  # rows 0 and 2: tokens of slots 3 and 1
    step = runner.prepare_rows(rows, starts, tables, qlens, pending)
    assert isinstance(step, BucketStep) is graph
    seen = runner.forward(step)[:, 0].tolist()
    assert seen == [703, rows[1][0], 701]


@pytest.mark.parametrize("graph", [True, False], ids=["bucket", "eager"])
def test_device_drafts_and_rejections_feed_the_rows(graph: bool) -> None:
    """Device drafters under overlap: draft rows read the slot pool's drafts (an absent one, -1,
    feeds token 0), and a request whose in-flight step rejected drafts moves back by them: its
    positions, KV slots (block-table lookups) and context length, in the graph and eagerly."""
    import numpy as np

    k = 3
    draft_ids = torch.full((5, k), -1, dtype=torch.int64)
    draft_ids[2] = torch.tensor([801, 802, -1])
    rejected = torch.zeros(5, dtype=torch.int64)
    rejected[2] = 2  # the step in flight of slot 2 rejected 2 of its rows
    model = EchoModel()
    cpu = torch.device("cpu")
    runner = ModelRunner(model, 1, 1, 1, 64, BS, torch.float32, cpu, 4, draft_ids, rejected)
    runner.init_cuda_graphs(4, 1 + k, 64, capture=True, progress=False, backend=FakeBackend())
    if not graph:
        runner.graphs = None
    runner.next_tokens[2] = 700
    # request 0 (slot 2): anchor + 3 drafts laid out from position 10 (all of the in-flight
    # step's drafts counted accepted); request 1: a plain row at position 5
    rows, starts, tables = [[0, 0, 0, 0], [55]], [10, 5], [[3, 4, 5, 6], [7, 8]]
    pending = np.array([2, 0, 0, 0, 0], dtype=np.int64)
    draft_at = np.array([0, 2 * k + 1, 2 * k + 2, 2 * k + 3, 0], dtype=np.int64)
    shift = np.array([2, 2, 2, 2, 0], dtype=np.int64)
    step = runner.prepare_rows(rows, starts, tables, [4, 1], pending, None, draft_at, shift)
    assert isinstance(step, BucketStep) is graph
    ids, pos, slot, ctx_len, bt_slot = runner.forward(step)[:5, :5].long().T.tolist()
    assert ids == [700, 801, 802, 0, 55]
    assert pos == [8, 9, 10, 11, 5]
    assert slot == bt_slot == [5 * BS, 5 * BS + 1, 5 * BS + 2, 5 * BS + 3, 8 * BS + 1]
    assert ctx_len == [12, 12, 12, 12, 6]


def test_not_eligible_runs_eager() -> None:
    rng = random.Random(0)
    runner, _ = _echo_runner()
    rows, starts, tables = _batch(rng, [3, 1], [1])
    # a prefill chunk: only its last row wants logits
    assert isinstance(runner.prepare_rows(rows, starts, tables, [1, 1]), StepInputs)
    # more rows than 1 + k for one request
    rows, starts, tables = _batch(rng, [5, 1], [1])
    assert isinstance(runner.prepare_rows(rows, starts, tables, [5, 1]), StepInputs)
    # more rows than the largest bucket
    rows, starts, tables = _batch(rng, [4, 4, 4, 4, 1], [1])
    assert isinstance(runner.prepare_rows(rows, starts, tables, [4, 4, 4, 4, 1]), StepInputs)


@pytest.mark.parametrize("seed", range(4))
def test_a_step_with_a_prompt_chunk_runs_in_a_mixed_bucket(seed: int) -> None:
    """Prompt chunks beside decodes: the smallest mixed bucket that holds the rows, every row
    laid out as the eager path lays it out, logits for exactly the rows that want them;
    captured before the decode buckets, largest first; past the largest, eager."""
    rng = random.Random(seed)
    runner, model = _echo_runner(mixed=100)
    assert runner.graphs.mixed_sizes == [64, 100]
    # capture: the mixed buckets first (any rows per request), then the decode ones
    assert [(c.slot_mapping.shape[0], c.max_query_len) for c in model.ctxs[:2]] == [
        (100, 100),
        (64, 64),
    ]
    eager, _ = _echo_runner()  # no mixed buckets: the eager path
    buckets = set()
    for i in range(8):
        qlens = [rng.randint(1, 4) for _ in range(rng.randint(0, 2))]
        qlens += [rng.randint(5, 40) for _ in range(rng.randint(1, 2))]
        qlens = [1, 40, 40] if i == 7 else qlens  # past the first bucket
        rng.shuffle(qlens)
        want = [q if q <= 4 and rng.random() < 0.5 else rng.randint(0, 1) for q in qlens]
        rows, starts, tables = _batch(rng, qlens, [1])
        step = runner.prepare_rows(rows, starts, tables, want)
        assert isinstance(step, BucketStep) and step.bucket.mixed
        assert step.bucket.rows == (64 if sum(qlens) <= 64 else 100)
        buckets.add(step.bucket.rows)
        got = runner.forward(step)
        ref = eager.forward(eager.prepare_rows(rows, starts, tables, want))
        assert got.shape[0] == sum(want) and torch.equal(got, ref)
        assert model.ctxs[-1].max_query_len == step.bucket.rows
    assert buckets == {64, 100}
    assert runner.graphs.num_mixed_runs == 8 and runner.graphs.num_replays == 0
    rows, starts, tables = _batch(rng, [30, 30, 30, 30], [1])  # 120 rows
    assert isinstance(runner.prepare_rows(rows, starts, tables, [1] * 4), StepInputs)
    rows, starts, tables = _batch(rng, [1, 1], [1])  # decode steps keep their buckets
    assert not runner.prepare_rows(rows, starts, tables, [1, 1]).bucket.mixed


def test_eager_twin_without_capture() -> None:
    runner = ModelRunner(EchoModel(), 1, 1, 1, 64, BS, torch.float32, torch.device("cpu"))
    runner.init_cuda_graphs(4, 4, 64, capture=False, progress=False, backend=FakeBackend())
    rows, starts, tables = _batch(random.Random(1), [2, 1], [1])
    step = runner.prepare_rows(rows, starts, tables, [2, 1])
    assert isinstance(step, BucketStep)
    runner.forward(step)
    assert runner.graphs.num_eager_runs == 1 and runner.graphs.num_replays == 0


def test_cpu_engine_has_no_graphs() -> None:
    runner = ModelRunner(EchoModel(), 1, 1, 1, 8, BS, torch.float32, torch.device("cpu"))
    runner.init_cuda_graphs(4, 4, 64)
    assert runner.graphs is None


# -- real model ------------------------------------------------------------------------------


def _tiny_runner(device: torch.device, dtype: torch.dtype, backend=None, k: int = 3):
    cfg = dummy_config("tiny")
    model = build_empty_model(cfg, dtype, device)
    init_random_(model)
    runner = ModelRunner(
        model, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 256, BS, dtype, device
    )
    for c in runner.kv_caches:  # a random "history" for every context to attend to
        c.k.normal_()
        c.v.normal_()
    runner.init_cuda_graphs(8, 1 + k, 256, progress=False, backend=backend, max_mixed_rows=128)
    return runner


def _compare_paths(
    runner: ModelRunner, seed: int, exact: bool, atol: float, mixed: bool = False
) -> None:
    """Graph replay against its eager twin (exact) and the plain eager path (close); mixed:
    steps with a prompt chunk of up to 60 rows, some rows wanting logits."""
    rng = random.Random(seed)
    graphs = runner.graphs
    for _ in range(6):
        qlens = [rng.randint(1, 4) for _ in range(rng.randint(1, 8 - mixed))]
        qlens += [rng.randint(5, 60)] * mixed
        want = [q if q <= 4 else 1 for q in qlens]
        # distinct blocks within a step (at most 88 of the 256); steps reuse them
        rows, starts, tables = _batch(rng, qlens, [1])
        step = runner.prepare_rows(rows, starts, tables, want)
        assert isinstance(step, BucketStep) and step.bucket.mixed == mixed
        graphs.use_graphs = True
        got = runner.forward(step).clone()
        graphs.use_graphs = False
        twin = runner.forward(step).clone()
        graphs.use_graphs = True
        runner.graphs = None  # the plain eager path: unpadded rows, its own launch parameters
        try:
            plain = runner.forward(runner.prepare_rows(rows, starts, tables, want))
        finally:
            runner.graphs = graphs
        assert torch.isfinite(got).all()
        if exact:
            assert torch.equal(got, twin)
        torch.testing.assert_close(got, plain, atol=atol, rtol=0)


@pytest.mark.parametrize("mixed", [False, True])
def test_bucket_path_matches_eager_cpu(mixed: bool) -> None:
    runner = _tiny_runner(torch.device("cpu"), torch.float32, FakeBackend())
    _compare_paths(runner, 0, exact=True, atol=1e-5, mixed=mixed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_replay_bit_identical(cuda: torch.device, dtype: torch.dtype) -> None:
    if cuda.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    runner = _tiny_runner(cuda, dtype)
    assert runner.graphs is not None
    # bf16 rounds differently with another row count per GEMM; fp32 is true fp32 (no tf32)
    _compare_paths(runner, 1, exact=True, atol=3e-2 if dtype == torch.bfloat16 else 1e-4)
    assert runner.graphs.num_replays == 6 and runner.graphs.num_verify_replays > 0
    _compare_paths(runner, 2, True, 3e-2 if dtype == torch.bfloat16 else 1e-4, mixed=True)
    assert runner.graphs.num_mixed_runs == 12  # replayed and its twin


# -- engine: graphs vs enforce_eager ---------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "verify_budget": "off"}


def _generate(model: str, dtype: str, spec: dict | None, enforce_eager: bool):
    from specserve import LLM, SamplingParams

    llm = LLM(
        model,
        speculative_config=spec,
        dtype=dtype,
        max_num_seqs=8,
        max_model_len=1024,
        kv_cache_memory_gb=1.0,
        enforce_eager=enforce_eager,
        progress=False,
    )
    rng = random.Random(0)
    lens = [5, 17, 40, 64, 100, 9]
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in lens]
    prompts.append([101, 102, 103, 104] * 12)  # repeats: n-gram drafts from the start
    maxes = [300, 240, 170, 100, 50, 12, 200]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in maxes]
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert [len(t) for t in tokens] == maxes
    return tokens, llm.engine.runner.graphs, llm.engine.device_drafting is not None


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("model", ["dummy:tiny", "dummy:smollm2-135m"])
def test_engine_graphs_match_eager(
    cuda: torch.device, model: str, dtype: str, spec: dict | None
) -> None:
    if cuda.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    from specserve import env

    with env.override(mixed_graphs=True):  # the prompts' steps too, in mixed buckets
        eager, eg, _ = _generate(model, dtype, spec, enforce_eager=True)
        graphed, gg, on_device = _generate(model, dtype, spec, enforce_eager=False)
    assert eg.num_replays == 0 and eg.num_eager_runs > 0
    assert gg.num_replays > 0 and gg.num_eager_runs == 0
    assert eg.num_mixed_runs > 0 and gg.num_mixed_runs > 0  # the prompts, padded
    if spec is not None:
        assert gg.num_verify_replays > 0
        # host drafting: steps where nobody verifies drafts take the decode-shaped graph (and
        # the eager twin the same attention tiles). Device drafting lays k draft rows out for
        # every decode step (the drafts are on the device), so it always takes verify graphs
        assert on_device or gg.num_decode_variant_replays > 0
    for i, (a, b) in enumerate(zip(eager, graphed)):
        same = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert same is None, f"request {i}: first difference at token {same}"


@pytest.mark.gpu
def test_a_dropped_engine_frees_the_device_for_the_next(cuda: torch.device) -> None:
    """A CUDA engine freezes what start-up built (engine/device.py); one dropped afterwards is
    released when the next engine is built, so a KV cache sized as a share of the device fits
    (the EAGLE-3 trainer's evaluation engine once found 43 GiB still held)."""
    if cuda.type != "cuda":
        pytest.skip("needs a CUDA device")
    import gc
    import weakref

    from specserve import LLM, SamplingParams

    first = LLM("dummy:smollm2-135m", max_num_seqs=4, gpu_memory_utilization=0.5, progress=False)
    held = torch.cuda.memory_allocated(cuda)
    ref = weakref.ref(first.engine)
    del first
    second = LLM("dummy:smollm2-135m", max_num_seqs=4, gpu_memory_utilization=0.5, progress=False)
    engine = ref()
    # what still holds a dropped engine, named for the failure message
    holders = [type(r).__name__ for r in gc.get_referrers(engine)] if engine is not None else []
    del engine
    assert not holders, f"the dropped engine is still referenced by {holders}"
    now = torch.cuda.memory_allocated(cuda)
    assert now <= held * 1.05, (
        f"{now / 2**20:.0f} MiB allocated, {held / 2**20:.0f} with one engine"
    )
    out = second.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert out[0].outputs[0].token_ids


@pytest.mark.gpu
def test_serving_compiles_no_attention_variant_after_start_up(cuda: torch.device) -> None:
    """Start-up compiles every attention variant an eager step can take (each tile class, its
    keys split or not): a variant first met while serving stalls its step for about a second,
    as a drafter's catch-up over a long context did."""
    if cuda.type != "cuda":
        pytest.skip("Triton compiles only for a CUDA device")
    from specserve import LLM, SamplingParams
    from specserve.ops import triton_attention
    from tests.gpu.test_triton_attention import compiled_variants

    llm = LLM(
        "dummy:smollm2-135m",
        dtype="bfloat16",
        max_num_seqs=4,
        max_model_len=2048,
        max_num_batched_tokens=128,
        kv_cache_memory_gb=1.0,
        progress=False,
    )
    kernel = triton_attention._kernels()._paged_attention_kernel
    before = compiled_variants(kernel)
    rng = random.Random(1)
    # prompts chunked at 128 rows over contexts up to 1,500 keys (split launches), of 1 to 42
    # rows per chunk tile class, then decode steps beside them
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (3, 40, 700, 1500)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)
    assert compiled_variants(kernel) == before
