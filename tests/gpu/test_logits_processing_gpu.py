"""logit_bias / allowed_token_ids / bad_words and prompt_logprobs on the GPU: the processed logits
feed the fused Triton verify (same tokens as the torch reference), greedy speculation stays
lossless, prompt logprobs match the CPU's, and no step synchronises with the host."""

from __future__ import annotations

import random

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.env import override
from tests.gpu.conftest import steps_without_host_sync

pytestmark = pytest.mark.gpu

MODEL = "dummy:smollm2-135m"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
ALLOWED = [260, 2644, 2643, 335, 1171, 2767, 7674, 253]  # " the", " cat", ... (SmolLM2 ids)


def _llm(device: str, dtype: str = "bfloat16", **kw) -> LLM:
    kw.setdefault("max_num_seqs", 8)
    return LLM(
        MODEL,
        device=device,
        dtype=dtype,
        max_model_len=512,
        kv_cache_memory_gb=0.5,
        debug_invariants=True,
        progress=False,
        **kw,
    )


def _workload():
    rng = random.Random(0)
    base = [[rng.randrange(3, 49152) for _ in range(n)] for n in (6, 11, 40, 20)]
    prompts = [p * 3 for p in base]  # repeats: the n-gram drafter finds drafts
    g = dict(max_tokens=40, ignore_eos=True, temperature=0.0)
    s = dict(max_tokens=40, ignore_eos=True, temperature=1.0, seed=7)
    params = [
        SamplingParams(**g, allowed_token_ids=ALLOWED),
        SamplingParams(**g, logit_bias={ALLOWED[0]: 5.0, 4321: 3.0, 17: -100.0}),
        SamplingParams(**g, allowed_token_ids=ALLOWED, bad_words=[" the the", " cat cat", " on"]),
        SamplingParams(**s, allowed_token_ids=ALLOWED, logit_bias={ALLOWED[3]: 2.0}),
    ]
    return prompts, params


def _ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_fused_verify_sees_the_processed_logits(cuda: torch.device) -> None:
    if cuda.type != "cuda":
        pytest.skip("needs a CUDA device")
    prompts, params = _workload()
    off = _ids(_llm("cuda"), prompts, params)
    spec = _llm("cuda", speculative_config=NGRAM)
    fused = _ids(spec, prompts, params)
    with override(fused_verify=False):
        reference = _ids(spec, prompts, params)
    assert fused == reference  # the Triton pass and the torch reference agree
    assert fused[:3] == off[:3]  # greedy: lossless
    assert fused[3] == off[3]  # seeded sampling with one-hot drafts: the spec-off tokens
    assert spec.get_metrics()["spec_accepted_tokens"] > 0
    assert all(t in ALLOWED for i in (0, 2, 3) for t in fused[i])


def test_prompt_logprobs_agree_with_chunking_and_with_decode_logprobs(cuda: torch.device) -> None:
    """fp32 on the GPU: whole and chunked prefill give the same prompt logprobs, and they equal
    the sample logprobs of the same tokens forced as outputs (golden_token_ids), which come
    from decode steps (CUDA graphs)."""
    if cuda.type != "cuda":
        pytest.skip("needs a CUDA device")
    prompts, _ = _workload()
    sp = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    whole = [
        o.prompt_logprobs for o in _llm("cuda", "float32").generate(prompts, sp, use_tqdm=False)
    ]
    small = _llm("cuda", "float32", max_num_seqs=2, max_num_batched_tokens=16)
    chunked = [o.prompt_logprobs for o in small.generate(prompts, sp, use_tqdm=False)]
    for a, b, p in zip(whole, chunked, prompts):
        assert len(a) == len(b) == len(p) and a[0] is None and b[0] is None
        for i in range(1, len(p)):
            assert a[i][p[i]].logprob == pytest.approx(b[i][p[i]].logprob, abs=1e-3)
    head, tail = prompts[2][:10], prompts[2][10:30]
    forced = SamplingParams(
        max_tokens=len(tail), ignore_eos=True, golden_token_ids=tail, logprobs=0
    )
    out = small.generate([head], forced, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tail
    scored = small.generate([head + tail], sp, use_tqdm=False)[0].prompt_logprobs
    for i, t in enumerate(tail):
        assert out.logprobs[i][t].logprob == pytest.approx(scored[10 + i][t].logprob, abs=1e-3)


def test_no_host_sync_inside_a_step_with_processing(cuda: torch.device) -> None:
    """As tests/gpu/test_overlap.py's guard, with every field of this feature in the batch
    (bad words keep their steps synchronous; the others overlap)."""
    if cuda.type != "cuda":
        pytest.skip("needs a CUDA device")
    llm = _llm("cuda", overlap=True)
    eng = llm.engine
    prompts, params = _workload()
    params = params + [SamplingParams(max_tokens=8, prompt_logprobs=2)]
    prompts = prompts + [prompts[2]]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    steps_without_host_sync(eng, prompts, params)


@pytest.mark.parametrize("every", [False, True])
def test_grammar_mask_kernel_equals_the_torch_path(cuda: torch.device, every: bool) -> None:
    """xgrammar's Triton bitmask kernel (SPECSERVE_GRAMMAR_MASK_OP=auto on CUDA) masks exactly
    what the byte-table path masks, ids past the bitmask included, without a host sync."""
    if cuda.type != "cuda":
        pytest.skip("xgrammar's kernel wrapper needs a CUDA device")
    from specserve.ops import logits_processing
    from specserve.ops.logits_processing import apply_bitmask_

    gen = torch.Generator().manual_seed(0)
    vocab = 128256 + 64  # 64 ids past the bitmask's 4008 words
    bits = torch.randint(-(2**31), 2**31 - 1, (9, 4008), dtype=torch.int32, generator=gen)
    logits = torch.randn(9, vocab, generator=gen).to(cuda)
    bits = bits.to(cuda)
    rows = None if every else torch.tensor([0, 3, 4, 8], device=cuda)
    with override(grammar_mask_op="torch"):
        want = apply_bitmask_(logits.clone(), rows, bits)
    apply_bitmask_(logits.clone(), rows, bits)  # Triton compiles the kernel at its first call
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = apply_bitmask_(logits.clone(), rows, bits)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not logits_processing.kernel_failed  # the kernel ran, not the fallback
    assert torch.equal(got, want)
