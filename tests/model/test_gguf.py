"""The real default model (SmolLM2-135M-Instruct Q4_1 GGUF) vs transformers' own GGUF loader.

transformers needs ~30 s to load this GGUF and ~12 s to generate the references, so its outputs
(tokens and a few logit rows) are computed once and kept under $SPECSERVE_CACHE/test-refs, keyed
by the GGUF file, the transformers version and the prompts. Our side always runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from specserve.model.errors import ModelLoadError
from specserve.model.loader import LoadedModel, cache_dir, load_model
from tests.model.harness import PagedRunner, assert_logits_close, greedy, one_thread

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "List three prime numbers greater than 10.",
    "How do I reverse a list in Python?",
]
NEW_TOKENS = 64
LOGIT_ROWS = 12  # rows of prompt 0 compared as logits: its last prompt row + generated rows
REF_FORMAT = 1  # bump when the reference contents change


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def smol(default_gguf_path: Path) -> LoadedModel:
    return load_model(str(default_gguf_path), torch.float32, torch.device("cpu"), progress=False)


@pytest.fixture(scope="module")
def prompts(smol: LoadedModel) -> list[list[int]]:
    out = []
    for q in QUESTIONS:
        ids = smol.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def _cut(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def _hf_reference(gguf: Path, prompts: list[list[int]], eos: int) -> dict[str, Any]:
    import transformers

    st = gguf.stat()
    key_src = [gguf.name, st.st_size, st.st_mtime_ns, transformers.__version__, prompts, NEW_TOKENS]
    key = hashlib.sha256(json.dumps([REF_FORMAT, LOGIT_ROWS, *key_src]).encode()).hexdigest()[:16]
    path = cache_dir() / "test-refs" / f"smollm2-gguf-{key}.pt"
    if path.is_file():
        return torch.load(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    tokens = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(
                torch.tensor([p]), do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=eos
            )
            tokens.append(_cut(out[0, len(p) :].tolist(), eos))
        seq = prompts[0] + tokens[0]
        rows = hf(torch.tensor([seq])).logits[0, len(prompts[0]) - 1 :][:LOGIT_ROWS]
    ref = {"tokens": tokens, "logits": rows.clone()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(ref, tmp)
    os.replace(tmp, path)
    return ref


@pytest.fixture(scope="module")
def reference(default_gguf_path: Path, prompts: list[list[int]], smol: LoadedModel):
    return _hf_reference(default_gguf_path, prompts, smol.config.eos_token_ids[0])


def test_config_from_gguf_metadata(smol: LoadedModel) -> None:
    c = smol.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.eos_token_ids == [2]
    assert smol.tokenizer.chat_template and smol.tokenizer.eos_token_id == 2


def test_logits_match_hf(smol: LoadedModel, prompts: list[list[int]], reference) -> None:
    """Chunked prefill (a long and a short chunk) and decode rows vs transformers."""
    ref = reference["logits"]
    p0, gen = prompts[0], reference["tokens"][0]
    runner = PagedRunner(smol.model, smol.config, block_size=16)
    runner.logits([(0, p0[:20])])
    logits = runner.logits([(0, p0[20:])])
    assert_logits_close(logits[-1], ref[0], "last prompt row", atol=1e-4, rtol=1e-4)
    for step in range(min(LOGIT_ROWS - 1, len(gen))):
        got = runner.logits([(0, [gen[step]])])[0]
        assert_logits_close(got, ref[step + 1], f"decode step {step}", atol=1e-4, rtol=1e-4)


def test_greedy_matches_hf(smol: LoadedModel, prompts: list[list[int]], reference) -> None:
    """64 greedy tokens on 5 chat prompts, all decoded together in one paged batch."""
    eos = smol.config.eos_token_ids[0]
    runner = PagedRunner(smol.model, smol.config, num_blocks=64, block_size=16)
    got = greedy(runner, prompts, NEW_TOKENS, chunk=None, eos=eos)
    assert got == reference["tokens"]
    assert "Paris" in smol.tokenizer.decode(got[0])


@pytest.mark.parametrize("damage", ["bad_magic", "truncated_header", "truncated_data"])
def test_corrupt_gguf_raises(default_gguf_path: Path, tmp_path: Path, damage: str) -> None:
    data = default_gguf_path.read_bytes()
    if damage == "bad_magic":
        data = b"GGXX" + data[4:200_000]
    elif damage == "truncated_header":
        data = data[:100_000]
    else:
        data = data[: int(len(data) * 0.9)]
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(data)
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        load_model(str(bad), torch.float32, torch.device("cpu"), progress=False)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(str(path), torch.float32, torch.device("cpu"), progress=False)
