"""Sliding-window models vs transformers on the CPU: tiny random Mistral / Qwen2 / Qwen3
checkpoints with windows of 4-16 keys (tests/model/sliding.py), prompts and generations longer
than the window. Logits row by row (whole and chunked prefill, decode, verify-shaped steps),
then greedy generation through the engine with chunked prefill and with speculation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from specserve.model.loader import load_model
from tests.model import sliding
from tests.model.harness import PagedRunner, one_thread


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def sw_dirs(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any) -> dict[str, Path]:
    return sliding.save_dirs(tmp_path_factory.mktemp("tiny_sliding"), default_tokenizer)


@pytest.fixture(scope="module", params=list(sliding.FAMILIES))
def pair(request: pytest.FixtureRequest, sw_dirs: dict[str, Path]):
    path = sw_dirs[request.param]
    ours = load_model(str(path), torch.float32, torch.device("cpu"), progress=False)
    return request.param, path, ours, sliding.load_hf(path)


@pytest.fixture(scope="module")
def hf_ref(pair):
    _, _, ours, hf = pair
    return sliding.hf_reference(hf, ours.config.vocab_size)


def test_windows_per_layer_match_hf(pair) -> None:
    family, _, ours, hf = pair
    got = [layer.self_attn.window for layer in ours.model.layers]
    assert got == sliding.hf_windows(hf)
    assert any(got), family  # every family here slides somewhere
    if family.startswith("qwen"):
        assert 0 in got  # and keeps a full-attention layer


def test_the_window_changes_hf_logits(pair, hf_ref) -> None:
    """Guard for the tests below: on these prompts full attention gives other logits than the
    window, so matching HF means applying the window."""
    _, _, ours, _ = pair
    prompts, _, ref = hf_ref
    windows = [layer.self_attn.window for layer in ours.model.layers]
    try:
        for layer in ours.model.layers:
            layer.self_attn.window = 0
        logits = PagedRunner(ours.model, ours.config).logits([(0, prompts[0])])
    finally:
        for layer, w in zip(ours.model.layers, windows):
            layer.self_attn.window = w
    err = (logits[-1] - ref[0][len(prompts[0]) - 1]).abs().max()
    assert err > 1e-2


@pytest.mark.parametrize("chunk", [None, 3, 11])
def test_logits_match_hf(pair, hf_ref, chunk: int | None) -> None:
    """Chunks shorter and longer than the window; then verify-shaped and decode steps."""
    _, _, ours, _ = pair
    sliding.check_logits(ours.model, ours.config, hf_ref, chunk)


def test_engine_greedy_matches_hf_with_chunked_prefill_and_speculation(pair) -> None:
    family, path, ours, hf = pair
    sliding.check_engine_greedy(
        family, path, hf, ours.config.vocab_size, device="cpu", block_size=4
    )
