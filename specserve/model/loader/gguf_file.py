"""GGUF files (llama.cpp): dequantize once into a HF-style folder in the cache, then load that.

The first load reads the GGUF with the `gguf` package, dequantizes every tensor, undoes
llama.cpp's q/k row permutation, and writes config.json + safetensors shards under
$SPECSERVE_CACHE/gguf/<file-key>-<dtype>/; the tokenizer, converted by transformers, goes to
$SPECSERVE_CACHE/gguf/<file-key>-tokenizer/. The key is name + size + mtime, so later loads of
the same file only read those folders (seconds instead of ~25 s for SmolLM2).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from specserve.model.errors import ModelLoadError
from specserve.model.loader.common import LoadedModel, load_tokenizer
from specserve.model.loader.default_model import cache_dir
from specserve.model.loader.hf_dir import load_hf_dir

GGUF_MAGIC = b"GGUF"
_ARCHS = {
    "llama": "LlamaForCausalLM",  # llama.cpp also files Mistral under llama
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# llama.cpp permutes q/k rows for its interleaved rope only when converting these.
_PERMUTED_ARCHS = ("llama", "mistral")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_SHARD_BYTES = 2 << 30
_DONE = ".complete"  # written last: a cache folder without it is ignored  # keeps peak host memory of a conversion near one shard


def load_gguf(path: Path, dtype: torch.dtype, device: torch.device, progress: bool) -> LoadedModel:
    weights_dir = gguf_weights_folder(path, dtype, progress)
    tokenizer = load_tokenizer(_tokenizer_dir(path))
    return load_hf_dir(weights_dir, dtype, device, progress, name=path.name, tokenizer=tokenizer)


def gguf_weights_folder(path: Path, dtype: torch.dtype, progress: bool = False) -> Path:
    """The cached HF folder (config.json + safetensors in `dtype`) of this GGUF, and its
    tokenizer folder beside it; converted on first use. Other engines load it too (the vLLM
    comparison in tools/cpu_ab.py reads the same weights)."""
    weights_dir = cache_dir() / "gguf" / f"{_file_key(path)}-{str(dtype).removeprefix('torch.')}"
    tok_dir = _tokenizer_dir(path)
    if not (weights_dir / _DONE).is_file() or not (tok_dir / _DONE).is_file():
        # Parse and validate once, before any slow work: a corrupt file or an unsupported
        # architecture fails here, not after a tokenizer conversion.
        reader = open_reader(path)
        config = gguf_hf_config(reader, path)
        _cached(weights_dir, lambda d: _convert(reader, config, path, d, dtype, progress))
        _cached(tok_dir, lambda d: _convert_tokenizer(path, d))
    return weights_dir


def gguf_tokenizer_folder(path: Path) -> Path:
    """The cached transformers tokenizer for this GGUF (converting takes seconds; loading not)."""

    def build(d: Path) -> None:
        open_reader(path)  # our clear error for a bad file, not transformers' own
        _convert_tokenizer(path, d)

    return _cached(_tokenizer_dir(path), build)


def _file_key(path: Path) -> str:
    # size + mtime instead of a hash: hashing GBs of weights would cost more than it saves.
    st = path.stat()
    return f"{path.stem}-{st.st_size}-{st.st_mtime_ns}"


def _tokenizer_dir(path: Path) -> Path:
    return cache_dir() / "gguf" / f"{_file_key(path)}-tokenizer"


def _cached(out: Path, build: Callable[[Path], None]) -> Path:
    """Build `out` in a private temp folder and rename it in, so readers never see half of it."""
    if (out / _DONE).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        build(tmp)
        (tmp / _DONE).touch()
        if out.exists() and not (out / _DONE).is_file():
            shutil.rmtree(out, ignore_errors=True)  # an incomplete leftover from an old crash
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / _DONE).is_file():  # a concurrent build won the rename: use it
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def open_reader(path: Path) -> Any:
    import gguf

    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic bytes)")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # truncated/corrupt files fail deep inside numpy memmaps
        raise ModelLoadError(f"{path} is a corrupt or truncated GGUF file: {e}") from None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_hf_config(reader: Any, path: Path) -> dict[str, Any]:
    """A transformers-style config.json dict from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHS)}"
        )
    names = {t.name: t for t in reader.tensors}

    def need(key: str) -> Any:
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return v

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = int(names["token_embd.weight"].shape[-1])
    rope_scaling = None
    if "rope_freqs.weight" in names:
        # Llama 3.1-style scaling is stored as per-frequency divisors, not as its parameters.
        factors = _dequantize(names["rope_freqs.weight"]).astype(np.float32)
        rope_scaling = {"rope_type": "freq_factors", "factors": factors.tolist()}
    elif _field(reader, f"{arch}.rope.scaling.type") == "linear":
        factor = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))
        rope_scaling = {"rope_type": "linear", "factor": factor}
    eos = [
        int(i)
        for i in (
            _field(reader, "tokenizer.ggml.eos_token_id"),
            _field(reader, "tokenizer.ggml.eot_token_id"),
        )
        if i is not None
    ]
    return {
        "architectures": [_ARCHS[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "hidden_act": "silu",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(eos)),
    }


def _dequantize(t: Any) -> np.ndarray:
    from gguf.quants import dequantize

    return dequantize(t.data, t.tensor_type)


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: per head, rows (d, 2) go back to rotate-half (2, d)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF checkpoint name for a GGUF tensor; None for tensors that are metadata (rope_freqs)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name == "rope_freqs.weight":
        return None
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family model")


Q4_1_BYTES = 20  # one Q4_1 block: fp16 d, fp16 m, 16 bytes of 4-bit q for 32 weights


def split_q4_1(
    raw: torch.Tensor,  # [N, K/32 * 20] uint8: a Q4_1 tensor's bytes, one row per output channel
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [N, K] uint8 0..15, d, m [N, K/32] fp32
    """A Q4_1 tensor's blocks as tensors, value = d * q + m. Within a block, byte j holds weight
    j in its low nibble and weight j + 16 in its high nibble."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, Q4_1_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
    qs = blocks[..., 4:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, -1)
    return q, d, m


Q8_0_BYTES = 34  # one Q8_0 block: fp16 d, 32 int8 q


def split_q8_0(
    raw: torch.Tensor,  # [N, K/32 * 34] uint8: a Q8_0 tensor's bytes, one row per output channel
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [N, K] int8, d, m [N, K/32] fp32
    """A Q8_0 tensor's blocks in split_q4_1's form, value = d * q + m with m = 0."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, Q8_0_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, -1)
    return q, d, torch.zeros_like(d)


_SPLITS = {"q4_1": split_q4_1, "q8_0": split_q8_0}


def block_tensors(
    path: Path, kinds: tuple[str, ...] = ("q4_1", "q8_0")
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The GGUF's weights stored as Q4_1 or Q8_0 blocks (those of `kinds`), by HF name, as
    split_q4_1 / split_q8_0 return them (value = d * q + m), rows in HF order (q/k unpermuted as
    _convert does): fp32 CPU engines keep them as integer blocks (model/cpu_linear.py),
    quantization="int4" re-encodes the Q4_1 ones (model/quant_int4.py), neither through a round
    trip through fp32. Their raw bytes are cached beside the dequantized weights (the GGUF
    reader spends seconds parsing the tokenizer metadata)."""
    from safetensors.torch import load_file

    folder = cache_dir() / "gguf" / f"{_file_key(path)}-blocks"
    _cached(folder, lambda d: _save_blocks(path, d))
    out = {}
    for kind in kinds:
        raw = load_file(str(folder / f"{kind}.safetensors"))
        out.update({name: _SPLITS[kind](blocks) for name, blocks in raw.items()})
    return out


def _save_blocks(path: Path, out: Path) -> None:
    import gguf
    from safetensors.torch import save_file

    reader = open_reader(path)
    config = gguf_hf_config(reader, path)
    arch = _field(reader, "general.architecture")
    types = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}
    blocks: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in types}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        kind = next((k for k, v in types.items() if t.tensor_type == v), None)
        if name is None or kind is None:
            continue
        raw = np.asarray(t.data)  # [N, K/32 * bytes] uint8; whole rows permute as bytes
        if arch in _PERMUTED_ARCHS and (".q_proj." in name or ".k_proj." in name):
            heads = config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
            raw = unpermute_rope_rows(raw, heads)
        blocks[kind][name] = torch.from_numpy(np.array(raw))  # writable: t.data is a read-only map
    for kind, tensors in blocks.items():
        save_file(tensors, str(out / f"{kind}.safetensors"))


def _convert(
    reader: Any, config: dict[str, Any], path: Path, out: Path, dtype: torch.dtype, progress: bool
) -> None:
    from safetensors.torch import save_file

    arch = _field(reader, "general.architecture")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    weight_map: dict[str, str] = {}
    shard_files: list[str] = []

    def flush() -> None:
        nonlocal shard, shard_bytes
        fname = f"model-{len(shard_files):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
        shard_files.append(fname)
        shard, shard_bytes = {}, 0

    bar = tqdm(
        reader.tensors, desc=f"dequantizing {path.name}", unit="tensor", disable=not progress
    )
    try:
        for t in bar:
            name = hf_tensor_name(t.name)
            if name is None:
                continue
            w = _dequantize(t)
            if arch in _PERMUTED_ARCHS and (".q_proj." in name or ".k_proj." in name):
                w = unpermute_rope_rows(w, heads if ".q_proj." in name else kv_heads)
            if not w.flags.writeable:  # F32 tensors come back as views of the read-only mmap
                w = w.copy()
            tensor = torch.from_numpy(np.ascontiguousarray(w)).to(dtype)
            shard[name] = tensor
            shard_bytes += tensor.numel() * tensor.element_size()
            if shard_bytes >= _SHARD_BYTES:
                flush()
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{path}: could not dequantize tensors (corrupt file?): {e}") from None
    finally:
        bar.close()
    if shard:
        flush()
    index = {"metadata": {"source": str(path)}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(config, indent=1))


def _convert_tokenizer(path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    except Exception as e:
        raise ModelLoadError(f"{path}: could not build a tokenizer from the GGUF: {e}") from None
    tok.save_pretrained(str(out))
