"""A GGUF's integer blocks (specserve.model.gguf_blocks, loader.gguf_file.split_q8_0): Q8_0
bytes read as gguf's own dequantizer reads them, and blocks mapped onto module names, fused
shards and a tied head."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.model.gguf_blocks import by_module, joined
from specserve.model.loader import load_model
from specserve.model.loader.gguf_file import split_q8_0

CPU = torch.device("cpu")


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 20), blocks=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_q8_0_blocks_read_as_ggufs_dequantizer(rows: int, blocks: int, seed: int) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    rng = np.random.default_rng(seed)
    d = rng.uniform(1e-4, 1e-1, (rows, blocks)).astype(np.float16)
    q = rng.integers(-127, 128, (rows, blocks, 32)).astype(np.int8)
    raw = np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], axis=-1)
    raw = raw.reshape(rows, blocks * 34)
    want = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType.Q8_0).reshape(rows, -1))
    qt, dt, mt = split_q8_0(torch.from_numpy(raw))
    assert qt.dtype == torch.int8 and torch.equal(qt, torch.from_numpy(q.reshape(rows, -1)))
    assert torch.equal(mt, torch.zeros_like(dt))
    assert torch.equal(dt.repeat_interleave(32, 1) * qt.float(), want)


def test_blocks_land_on_modules_shards_and_a_tied_head(tiny_hf_dirs: dict[str, Path]) -> None:
    model = load_model(str(tiny_hf_dirs["llama_tied"]), torch.float32, CPU, progress=False).model
    qkv = model.layers[0].self_attn.qkv_proj.weight  # [q | k | v rows, hidden]
    rows = [model._shard_view(qkv, "layers.0.self_attn.qkv_proj.weight", i) for i in range(3)]

    def blocks_of(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = torch.ones(w.shape[0], w.shape[1] // 32)  # "q" = the weight itself, m = 0
        return w.to(torch.int8), d, torch.zeros_like(d)

    names = ("q_proj", "k_proj", "v_proj")
    tensors = {f"model.layers.0.self_attn.{p}.weight": blocks_of(w) for p, w in zip(names, rows)}
    tensors["model.embed_tokens.weight"] = blocks_of(model.embed_tokens.weight)
    source = by_module(model, tensors)
    assert set(source) == {"layers.0.self_attn.qkv_proj", "lm_head"}  # tied: the embedding
    assert [s[0].shape[0] for s in source["layers.0.self_attn.qkv_proj"]] == [
        r.shape[0] for r in rows
    ]
    # joined in the model's row order, and checked against the loaded weight
    with torch.no_grad():
        qkv.copy_(qkv.round().clamp(-127, 127))
    rows = [model._shard_view(qkv, "layers.0.self_attn.qkv_proj.weight", i) for i in range(3)]
    tensors.update(
        {f"model.layers.0.self_attn.{p}.weight": blocks_of(w) for p, w in zip(names, rows)}
    )
    got = joined(
        model,
        "layers.0.self_attn.qkv_proj",
        qkv,
        by_module(model, tensors)["layers.0.self_attn.qkv_proj"],
    )
    assert got is not None and torch.equal(got[0].float(), qkv)
    with pytest.raises(RuntimeError, match="do not match"):  # a wrong mapping fails loudly
        joined(model, "layers.0.self_attn.qkv_proj", qkv + 1, got_source(model, tensors))


def got_source(model, tensors) -> list:
    return by_module(model, tensors)["layers.0.self_attn.qkv_proj"]
