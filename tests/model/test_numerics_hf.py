"""Our model vs transformers on tiny random checkpoints of every family, loaded via load_model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.model.loader import load_model
from tests.conftest import TINY_FAMILIES
from tests.model.harness import PagedRunner, assert_logits_close, greedy, one_thread

FAMILIES = list(TINY_FAMILIES)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


def _hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (40, 9, 23)]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request: pytest.FixtureRequest, tiny_hf_dirs: dict[str, Path]):
    path = tiny_hf_dirs[request.param]
    ours = load_model(str(path), torch.float32, torch.device("cpu"), progress=False)
    return ours, _hf(path)


@pytest.fixture(scope="module")
def hf_logits(pair):
    """Prompts, a 5-token continuation and HF's logits over each prompt + continuation."""
    ours, hf = pair
    prompts = _prompts(ours.config.vocab_size)
    continuation = _prompts(ours.config.vocab_size, seed=1)[1][:5]
    with torch.no_grad():
        ref = [hf(torch.tensor([p + continuation])).logits[0] for p in prompts]  # [L, V] each
    return prompts, continuation, ref


@pytest.mark.parametrize("chunk", [None, 7, 24])
def test_logits_match_hf(pair, hf_logits, chunk: int | None) -> None:
    """Prefill (whole, short chunks, long chunks) then single-row decode: every row vs HF."""
    ours, _ = pair
    prompts, continuation, ref = hf_logits
    runner = PagedRunner(ours.model, ours.config, block_size=8)
    done = [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        batch = []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                n = len(p) - done[i] if chunk is None else min(chunk, len(p) - done[i])
                batch.append((i, p[done[i] : done[i] + n], done[i]))
                done[i] += n
        logits = runner.logits([(i, toks) for i, toks, _ in batch])
        row = 0
        for i, toks, start in batch:
            got = logits[row : row + len(toks)]
            assert_logits_close(got, ref[i][start : start + len(toks)], f"prompt {i} rows {start}+")
            row += len(toks)
    for step, tok in enumerate(continuation):
        logits = runner.logits([(i, [tok]) for i in range(len(prompts))], pad_rows=step % 2)
        for i, p in enumerate(prompts):
            assert_logits_close(logits[i], ref[i][len(p) + step], f"prompt {i} decode step {step}")


def _cut(tokens: list[int], eos: set[int]) -> list[int]:
    for n, t in enumerate(tokens):
        if t in eos:
            return tokens[: n + 1]
    return tokens


def test_greedy_matches_hf_generate(pair) -> None:
    ours, hf = pair
    prompts = _prompts(ours.config.vocab_size, seed=2)
    eos = set(ours.config.eos_token_ids)
    runner = PagedRunner(ours.model, ours.config, block_size=16)
    got = greedy(runner, prompts, max_new=20, chunk=16)
    for p, g in zip(prompts, got):
        ids = torch.tensor([p])
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20
        )
        want = out[0, len(p) :].tolist()
        assert _cut(g, eos) == _cut(want, eos)


def test_config_and_tokenizer(pair) -> None:
    ours, hf = pair
    c, h = ours.config, hf.config
    assert c.vocab_size == h.vocab_size and c.num_hidden_layers == h.num_hidden_layers
    assert c.head_dim == getattr(h, "head_dim", None) or h.hidden_size // h.num_attention_heads
    assert c.tie_word_embeddings == h.tie_word_embeddings
    assert ours.tokenizer is not None and ours.tokenizer.chat_template
    assert not ours.model.training
    assert next(ours.model.parameters()).dtype == torch.float32


def test_bf16_load_runs(tiny_llama_dir: Path) -> None:
    ours = load_model(str(tiny_llama_dir), torch.bfloat16, torch.device("cpu"), progress=False)
    assert next(ours.model.parameters()).dtype == torch.bfloat16
    runner = PagedRunner(ours.model, ours.config, dtype=torch.bfloat16)
    logits = runner.logits([(0, [5, 6, 7]), (1, [9])])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
