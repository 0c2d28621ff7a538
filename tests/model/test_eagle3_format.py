"""EAGLE-3 head folders in the vLLM/SGLang format: written here independently of specserve's
saver (the names and shapes vLLM's and SGLang's llama_eagle3.py load), then loaded, checked and
round-tripped; malformed heads fail with an error naming the tensor or field."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from specserve.model.config import ModelConfig
from specserve.model.eagle3 import Eagle3Config, Eagle3Head
from specserve.model.errors import ModelLoadError
from specserve.model.loader.dummy import PRESETS
from specserve.model.loader.eagle3 import load_eagle3_head, save_eagle3_head


def head_tensors(
    hidden: int,
    target_hidden: int,
    inter: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    vocab: int,
    draft_ids: list[int],
    seed: int = 0,
    scale: float = 0.2,
    confidence: bool = False,
) -> dict[str, torch.Tensor]:
    """Random tensors named and shaped as vLLM/SGLang load them (no `model.` prefix, as
    SpecForge saves)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    d = len(draft_ids)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    out = {
        "fc.weight": r(hidden, 3 * target_hidden),
        "midlayer.input_layernorm.weight": 1 + r(hidden),
        "midlayer.hidden_norm.weight": 1 + r(hidden),
        "midlayer.self_attn.q_proj.weight": r(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": r(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": r(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": r(hidden, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": 1 + r(hidden),
        "midlayer.mlp.gate_proj.weight": r(inter, hidden),
        "midlayer.mlp.up_proj.weight": r(inter, hidden),
        "midlayer.mlp.down_proj.weight": r(hidden, inter),
        "norm.weight": 1 + r(hidden),
        "lm_head.weight": r(d, hidden) * 5,
        "d2t": torch.tensor(sorted(draft_ids), dtype=torch.int64) - torch.arange(d),
        "t2d": t2d,
    }
    if confidence:
        out["confidence_head.weight"] = r(1, 2 * hidden)
        out["confidence_head.bias"] = r(1)
    return out


def head_config(
    hidden: int,
    inter: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    vocab: int,
    draft_vocab: int,
    **extra,
) -> dict:
    """config.json as SpecForge writes it for a Llama-family EAGLE-3 head."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        **extra,
    }


def write_head(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def write_tiny_head(
    path: Path,
    target: ModelConfig,
    draft_ids: list[int],
    layer_ids: list[int] | None = None,
    seed: int = 0,
    confidence: bool = False,
) -> Path:
    """A random head for `target` (its hidden size; 2 heads of 16), vLLM/SGLang format."""
    h = target.hidden_size
    extra = {"eagle_aux_hidden_state_layer_ids": layer_ids} if layer_ids else {}
    cfg = head_config(h, 2 * h, 2, 1, 16, target.vocab_size, len(draft_ids), **extra)
    t = head_tensors(
        h, h, 2 * h, 2, 1, 16, target.vocab_size, draft_ids, seed, confidence=confidence
    )
    return write_head(path, cfg, t)


TINY = ModelConfig("LlamaForCausalLM", 100, 32, 64, 6, 4, 2, 8)
DRAFT_IDS = [3, 5, 8, 13, 21, 34, 55, 89]


@pytest.fixture
def tiny_head(tmp_path: Path) -> Path:
    return write_tiny_head(tmp_path / "head", TINY, DRAFT_IDS, [0, 2, 5], confidence=True)


def _embedding(cfg: ModelConfig) -> torch.nn.Embedding:
    torch.manual_seed(0)
    return torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)


def test_a_vllm_format_head_loads_with_its_tensors_and_runs(tiny_head):
    emb = _embedding(TINY)
    head = load_eagle3_head(tiny_head, TINY, "cpu", torch.float32, emb)
    from safetensors.torch import load_file

    written = load_file(str(tiny_head / "model.safetensors"))
    state = head.state_dict()
    assert set(state) == set(written)
    for name, t in written.items():
        assert torch.equal(state[name], t), name
    assert head.config.layer_ids(TINY.num_hidden_layers) == (0, 2, 5)
    assert head.draft_to_target().tolist() == DRAFT_IDS
    out = head(torch.tensor([[1, 2, 3]]), torch.randn(1, 3, 96), torch.arange(3)[None])
    assert out.logits.shape == (1, 3, len(DRAFT_IDS)) and out.confidence.shape == (1, 3)
    full = head.target_logits(out.logits[0])
    assert full.shape == (3, TINY.vocab_size)
    off = torch.ones(TINY.vocab_size, dtype=torch.bool)
    off[DRAFT_IDS] = False
    assert torch.isinf(full[:, off]).all() and torch.isfinite(full[:, DRAFT_IDS]).all()


def test_default_layer_ids_are_vllms():
    cfg = Eagle3Config.from_dict(head_config(32, 64, 2, 1, 16, 100, 10))
    assert cfg.layer_ids(32) == (2, 16, 29)
    nested = head_config(32, 64, 2, 1, 16, 100, 10)
    nested["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 9, 4]}
    assert Eagle3Config.from_dict(nested).layer_ids(12) == (1, 4, 9)


def test_save_then_load_is_the_same_head(tiny_head, tmp_path):
    emb = _embedding(TINY)
    head = load_eagle3_head(tiny_head, TINY, "cpu", torch.float32, emb)
    save_eagle3_head(head, None, tmp_path / "again")
    index = json.loads((tmp_path / "again" / "model.safetensors.index.json").read_text())
    # vLLM and SGLang load only the files an index names: the confidence file stays theirs unseen
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    assert not any(k.startswith("confidence_head") for k in index["weight_map"])
    again = load_eagle3_head(tmp_path / "again", TINY, "cpu", torch.float32, emb)
    a, b = head.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cfg = json.loads((tmp_path / "again" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 8
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]


def test_a_head_trained_from_scratch_saves_in_the_format(tmp_path):
    raw = head_config(32, 64, 2, 1, 16, 100, 100, eagle_aux_hidden_state_layer_ids=[1, 3, 4])
    cfg = Eagle3Config.from_dict(raw)
    head = Eagle3Head(cfg, _embedding(TINY), confidence_head=False)
    save_eagle3_head(head, cfg, tmp_path / "h")
    assert not (tmp_path / "h" / "confidence_head.safetensors").exists()
    again = load_eagle3_head(tmp_path / "h", TINY, "cpu", torch.float32, _embedding(TINY))
    assert again.confidence_head is None and again.draft_to_target().tolist() == list(range(100))
    assert again.config.layer_ids(TINY.num_hidden_layers) == (1, 3, 4)


def _break(tiny_head: Path, fn) -> Path:
    from safetensors.torch import load_file, save_file

    t = load_file(str(tiny_head / "model.safetensors"))
    cfg = json.loads((tiny_head / "config.json").read_text())
    fn(t, cfg)
    save_file(t, str(tiny_head / "model.safetensors"))
    (tiny_head / "config.json").write_text(json.dumps(cfg))
    return tiny_head


MALFORMED = {
    "missing fc": (lambda t, c: t.pop("fc.weight"), "'fc.weight'"),
    "missing qkv shard": (lambda t, c: t.pop("midlayer.self_attn.k_proj.weight"), "k_proj"),
    "qkv not 2H wide": (
        lambda t, c: t.update({"midlayer.self_attn.q_proj.weight": torch.zeros(32, 32)}),
        "'midlayer.self_attn.q_proj.weight' has shape (32, 32), expected (32, 64)",
    ),
    "lm_head vs draft vocab": (
        lambda t, c: t.update({"lm_head.weight": torch.zeros(9, 32)}),
        "'lm_head.weight' has shape (9, 32), expected (8, 32)",
    ),
    "d2t vs draft vocab": (lambda t, c: c.update(draft_vocab_size=9), "'d2t' has shape (8,)"),
    "d2t out of range": (lambda t, c: t["d2t"].add_(50), "'d2t'"),
    "t2d disagrees": (lambda t, c: t["t2d"].fill_(True), "'t2d'"),
    "half a confidence head": (lambda t, c: t.pop("confidence_head.bias"), "confidence_head.bias"),
    "stray tensor": (lambda t, c: t.update({"midlayer.extra": torch.zeros(1)}), "midlayer.extra"),
    "architecture": (lambda t, c: c.update(architectures=["LlamaForCausalLM"]), "architectures"),
    "missing field": (lambda t, c: c.pop("intermediate_size"), "'intermediate_size'"),
    "vocab": (lambda t, c: c.update(vocab_size=99), "vocab_size=99"),
    "hidden size": (lambda t, c: c.update(target_hidden_size=48), "target_hidden_size=48"),
    "layer ids": (
        lambda t, c: c.update(eagle_aux_hidden_state_layer_ids=[0, 2, 6]),
        "eagle_aux_hidden_state_layer_ids",
    ),
    "two layers": (lambda t, c: c.update(num_hidden_layers=2), "num_hidden_layers"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_head_names_what_is_wrong(tiny_head, case):
    fn, needle = MALFORMED[case]
    _break(tiny_head, fn)
    with pytest.raises(ModelLoadError) as e:
        load_eagle3_head(tiny_head, TINY, "cpu", torch.float32, _embedding(TINY))
    assert needle in str(e.value)


def test_a_missing_folder_names_the_field(tmp_path):
    with pytest.raises(ModelLoadError, match="speculative_config.model"):
        load_eagle3_head(tmp_path / "nope", TINY, "cpu", torch.float32, _embedding(TINY))


def _sparse_safetensors(path: Path, shapes: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """A safetensors file of zeros written sparsely (a header, then a hole): the 8B-shaped head's
    ~1 GB of data costs no disk and is never read (meta load)."""
    sizes = {"BF16": 2, "I64": 8, "BOOL": 1}
    header, offset = {}, 0
    for name, (shape, dtype) in shapes.items():
        n = sizes[dtype] * int(torch.tensor(shape).prod()) if shape else sizes[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)


def test_a_head_for_the_llama_8b_shape_loads_on_meta(tmp_path):
    target = ModelConfig.from_hf(PRESETS["llama-3.1-8b"])
    h, v, dv = target.hidden_size, target.vocab_size, 32000
    cfg = head_config(h, 14336, 32, 8, 128, v, dv, rope_theta=500000.0)
    shapes = {
        k: (tuple(t.shape), {torch.int64: "I64", torch.bool: "BOOL"}.get(t.dtype, "BF16"))
        for k, t in head_tensors(1, 1, 1, 1, 1, 1, 2, [0]).items()
    }
    real = {
        "fc.weight": (h, 3 * h),
        "midlayer.self_attn.q_proj.weight": (4096, 2 * h),
        "midlayer.self_attn.k_proj.weight": (1024, 2 * h),
        "midlayer.self_attn.v_proj.weight": (1024, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, 4096),
        "midlayer.mlp.gate_proj.weight": (14336, h),
        "midlayer.mlp.up_proj.weight": (14336, h),
        "midlayer.mlp.down_proj.weight": (h, 14336),
        "lm_head.weight": (dv, h),
        "d2t": (dv,),
        "t2d": (v,),
    }
    shapes = {k: (real.get(k, (h,)), dt) for k, (_, dt) in shapes.items()}
    d = tmp_path / "h8b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    _sparse_safetensors(d / "model.safetensors", shapes)
    with torch.device("meta"):
        emb = torch.nn.Embedding(v, h)
    head = load_eagle3_head(d, target, "meta", torch.bfloat16, emb)
    assert head.config.layer_ids(target.num_hidden_layers) == (2, 16, 29)
    assert head.fc.weight.shape == (h, 3 * h) and head.lm_head.weight.dtype == torch.bfloat16
    # one step on meta tensors checks every shape along the layer (attention stubbed: q)
    ids = torch.zeros(4, dtype=torch.int64, device="meta")
    aux = torch.zeros(4, 3 * h, dtype=torch.bfloat16, device="meta")
    pos = torch.zeros(4, dtype=torch.int64, device="meta")
    out = head.step(ids, aux, pos, lambda q, k, v: q, 8)
    assert out.prenorm.shape == (4, h) and out.logits.shape == (4, dv)
    assert out.confidence is None
    shapes["midlayer.mlp.up_proj.weight"] = ((14336, h + 1), "BF16")
    _sparse_safetensors(d / "model.safetensors", shapes)
    with pytest.raises(ModelLoadError, match="midlayer.mlp.up_proj.weight"):
        load_eagle3_head(d, target, "meta", torch.bfloat16, emb)


def test_a_head_named_by_hub_id_loads_from_the_local_hf_cache(tiny_head, tmp_path, monkeypatch):
    import shutil

    repo = tmp_path / "hub" / "models--someorg--EAGLE3-tiny"
    shutil.copytree(tiny_head, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    head = load_eagle3_head("someorg/EAGLE3-tiny", TINY, "cpu", torch.float32, _embedding(TINY))
    assert head.draft_to_target().tolist() == DRAFT_IDS
    with pytest.raises(ModelLoadError, match="speculative_config.model: model 'someorg/nope'"):
        load_eagle3_head("someorg/nope", TINY, "cpu", torch.float32, _embedding(TINY))
