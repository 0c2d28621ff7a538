"""EAGLE-3 numerics: every draft equals a from-scratch recomputation of the head over the
target's own hidden states (exact KV/store bookkeeping), the capture is the residual stream HF
reports, and rejection sampling with the head's q is lossless."""

from __future__ import annotations

import pytest
import torch

from specserve import SamplingParams, env
from specserve.model.aux_capture import AuxCapture
from specserve.model.config import ModelConfig
from specserve.model.loader import load_model
from specserve.ops.sampling import SamplingTensors, target_probs
from specserve.sample.layout import build_layout
from specserve.sample.verify import verify
from tests.engine.conftest import make_llm, prompts_of
from tests.model.harness import PagedRunner
from tests.model.test_eagle3_format import head_config, write_head
from tests.speculative.eagle3_heads import LAYERS, SP, TEMPS, _ids, _spec, _spy
from tests.speculative.test_lossless import CHI2_CRIT, _chi2


def _reference_drafts(llm, loaded, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
    """The head recomputed from scratch: the target's aux streams from one fresh prefill, then
    each chain step a dense causal pass over the whole extended sequence."""
    head = llm.engine.drafter.head
    cap = AuxCapture(tuple(LAYERS), loaded.config.hidden_size, 256, torch.float32, "cpu")
    loaded.model.aux_capture = cap
    n = len(tokens)
    PagedRunner(loaded.model, loaded.config).forward([(0, tokens[: n - 1])])
    with torch.no_grad():
        hidden = head.fc(cap.rows[: n - 1])  # [N-1, H] g at positions 0..N-2
        ids, drafts, confs = list(tokens[1:]), [], []
        for _ in range(k):
            pos = torch.arange(len(ids))[None]
            out = head(torch.tensor([ids]), hidden[None], pos)
            d = int(head.draft_to_target()[out.logits[0, -1].argmax()])
            drafts.append(d)
            # no confidence head: the drafted token's q, 1 for a greedy (one-hot) draft
            c, temp = out.confidence, TEMPS[min(len(drafts) - 1, len(TEMPS) - 1)]
            confs.append(1.0 if c is None else float(torch.sigmoid(c[0, -1] / temp)))
            ids.append(d)
            hidden = torch.cat([hidden, out.prenorm[0, -1:]])
    return drafts, confs


def _plan_every(llm, n: int) -> None:
    """The verify budget plans no drafts for n - 1 rounds in n (nothing is drafted, a plain
    step follows: overlapped where the engine overlaps) and all of each request's room in the
    other, independent of timing."""
    calls = [0]

    def allot(surv, base_rows, room=None):
        calls[0] += 1
        return list(room) if calls[0] % n == 0 else [0] * len(room)

    llm.engine.budget.allot = allot


@pytest.mark.parametrize("head,every", [("copy", 1), ("random", 2), ("random", 4)])
def test_every_draft_is_the_head_recomputed_from_scratch(target, prompts, ref, heads, head, every):
    """Catch-up, chain, rollback after accepts and rejects, preemption, prefix-cache reuse and
    the plain steps between drafting rounds (forced for the random head: overlapped when every
    other round drafts; synchronous, three plain steps in a row that draft nothing, when every
    fourth does) leave the head's KV and the stored hidden states exactly what a fresh
    computation gives."""
    kw = {"verify_budget": "off"} if every == 1 else {}
    with env.override(device_drafts=False):  # the host drafter (its proposals are spied on)
        llm = make_llm(
            model=target[0],
            speculative_config=_spec(heads[head], k=3, **kw),
            kv_cache_memory_gb=10 * 16384 / 2**30,
            max_num_batched_tokens=48,
            max_num_seqs=8,
            overlap=every == 2,
            debug_invariants=True,
        )
    records = _spy(llm)
    if every > 1:
        _plan_every(llm, every)
    outs = llm.generate(prompts, SP, use_tqdm=False)
    assert _ids(outs) == ref
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    if head == "copy":
        assert llm.get_metrics()["spec_accepted_tokens"] > 0
    else:
        if every == 2:
            assert llm.engine.num_sync_steps < llm.engine.num_steps  # some ran overlapped
        # drafting resumed after plain steps: its catch-up read g stored by those steps
        assert max(r[3] for r in records) > 4
    loaded = load_model(target[0], torch.float32, torch.device("cpu"), progress=False)
    checked = 0
    late = [r for r in records if r[3] > 4]
    for tokens, drafts, confs, _ in records[:: max(1, len(records) // 12)] + late[:3]:
        want, want_c = _reference_drafts(llm, loaded, tokens, len(drafts))
        assert drafts == want
        assert confs == pytest.approx(want_c, abs=1e-4)
        checked += 1
    assert checked >= 10


def test_capture_is_the_residual_stream_entering_each_layer(tiny_llama_dir):
    """vLLM's aux hidden state of layer i is layer i's input: HF's hidden_states[i]."""
    from tests.conftest import make_tiny_hf_model

    hf = make_tiny_hf_model("llama")
    loaded = load_model(str(tiny_llama_dir), torch.float32, torch.device("cpu"), progress=False)
    cap = AuxCapture((1, 0), loaded.config.hidden_size, 64, torch.float32, "cpu")
    loaded.model.aux_capture = cap
    ids = prompts_of([11], seed=5)[0]
    ids = [i % loaded.config.vocab_size for i in ids]
    PagedRunner(loaded.model, loaded.config).forward([(0, ids)])
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    h = loaded.config.hidden_size
    assert cap.num_rows == 11
    torch.testing.assert_close(cap.rows[:11, :h], hs[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cap.rows[:11, h : 2 * h], hs[1][0], rtol=1e-5, atol=1e-5)


def test_rejection_sampling_with_the_heads_q_is_lossless(tmp_path):
    """q = the head's distribution over its draft vocabulary, mapped into the target's (0 off it):
    the first emitted token is distributed as the target p (chi-square, as test_lossless)."""
    from specserve.model.loader.eagle3 import load_eagle3_head
    from specserve.ops.random import hashed_uniform
    from specserve.ops.sampling import DRAFT_SALT
    from tests.model.test_eagle3_format import head_tensors
    from tests.speculative.test_lossless import N, V

    tc = ModelConfig("LlamaForCausalLM", V, 16, 32, 4, 2, 1, 8)
    draft_ids = [1, 2, 4, 6, 7]  # 0, 3, 5 lie outside the draft vocabulary: q = 0 there
    cfg = head_config(
        16, 32, 2, 1, 8, V, len(draft_ids), eagle_aux_hidden_state_layer_ids=[0, 1, 3]
    )
    path = write_head(tmp_path / "h", cfg, head_tensors(16, 16, 32, 2, 1, 8, V, draft_ids, seed=4))
    torch.manual_seed(0)
    head = load_eagle3_head(path, tc, "cpu", torch.float32, torch.nn.Embedding(V, 16))
    with torch.no_grad():
        out = head(torch.tensor([[3]]), torch.randn(1, 1, 48), torch.zeros(1, 1, dtype=torch.long))
    head_logits = head.target_logits(out.logits[0])  # [1, V], -inf off the draft vocab
    g = torch.Generator().manual_seed(1)
    target_logits = torch.randn(V, generator=g) * 1.5
    params = SamplingParams(temperature=1.0)
    seqlens = torch.full((N,), 2, dtype=torch.int64)
    layout = build_layout(seqlens, 2 * N, 1)
    t = SamplingTensors.build(
        [params] * (2 * N), [s for s in range(N) for _ in range(2)], [0, 1] * N, "cpu"
    )
    q = target_probs(head_logits.expand(2 * N, V).contiguous(), t)
    assert (q[:, [0, 3, 5]] == 0).all() and q[0, draft_ids].sum() == pytest.approx(1.0)
    u = hashed_uniform(t.seed, t.counter, DRAFT_SALT, V)
    drafts = (q / -torch.log(u)).argmax(-1)
    drafts = torch.stack([drafts[0::2], torch.zeros(N, dtype=torch.int64)], 1).reshape(-1)
    res = verify(target_logits.expand(2 * N, V).contiguous(), drafts, q, t, layout)
    first = torch.where(
        res.verified_token_ids[0::2] >= 0,
        res.verified_token_ids[0::2].long(),
        res.sampled_token_ids,
    )
    p = target_probs(target_logits[None], SamplingTensors.build([params], [0], [0], "cpu"))[0]
    assert _chi2(first, p) < CHI2_CRIT
    # and some drafts were rejected, others accepted: both branches were exercised
    acc = (res.verified_token_ids[0::2] >= 0).float().mean()
    assert 0.05 < float(acc) < 0.95
