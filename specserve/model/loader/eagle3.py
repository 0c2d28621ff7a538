"""EAGLE-3 head folders, in the format vLLM and SGLang load (and SpecForge writes); a hub id is
read from the local Hugging Face cache (never downloaded).

    config.json                    architectures ["LlamaForCausalLMEagle3"], draft_vocab_size, ...
    model.safetensors              the head's tensors (names in model/eagle3.py); or
                                   pytorch_model.bin, or shards named by model.safetensors.index.json
    model.safetensors.index.json   (written by save) lists model.safetensors only
    confidence_head.safetensors    specserve's confidence head; absent from the index, so vLLM and
                                   SGLang (which load only the files an index names) never see it

Every tensor is checked by name and shape before anything is copied; a malformed head raises
ModelLoadError naming the tensor (or config field) at fault.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specserve.model.config import ModelConfig
from specserve.model.eagle3 import Eagle3Config, Eagle3Head
from specserve.model.errors import ModelLoadError
from specserve.model.loader.hf_dir import read_json, safetensors_files
from specserve.model.loader.hub_cache import looks_like_hub_id, resolve_hub_id

CONFIDENCE_FILE = "confidence_head.safetensors"
_CONFIDENCE = ("confidence_head.weight", "confidence_head.bias")


def _normalise(name: str) -> str:
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def _read_tensors(path: Path, meta: bool) -> dict[str, torch.Tensor]:
    """name -> tensor (meta: shape-only stand-ins read from the headers, no data)."""
    if any(path.glob("*.safetensors")):
        from safetensors import safe_open

        files = [f for f in safetensors_files(path) if f.name != CONFIDENCE_FILE]
        if (path / CONFIDENCE_FILE).is_file():
            files.append(path / CONFIDENCE_FILE)
        out = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as sf:
                    for name in sf.keys():
                        if meta:
                            sl = sf.get_slice(name)
                            dtype = _ST_DTYPES.get(sl.get_dtype(), torch.float32)
                            out[_normalise(name)] = torch.empty(
                                sl.get_shape(), dtype=dtype, device="meta"
                            )
                        else:
                            out[_normalise(name)] = sf.get_tensor(name)
            except Exception as e:  # safetensors raises its own types for corrupt files
                raise ModelLoadError(f"{f}: unreadable safetensors file: {e}") from None
        return out
    bins = sorted(path.glob("*.bin"))
    if not bins:
        raise ModelLoadError(f"EAGLE-3 head {path} holds no *.safetensors or *.bin weights")
    out = {}
    for f in bins:
        try:
            state = torch.load(f, map_location="meta" if meta else "cpu", weights_only=True)
        except Exception as e:
            raise ModelLoadError(f"{f}: unreadable checkpoint: {e}") from None
        out.update({_normalise(k): v for k, v in state.items()})
    return out


_ST_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "BOOL": torch.bool,
}


# EAGLE-3 heads shipped inside the package, for the default model (trained by `specserve
# train-head`; the README records how)
SHIPPED_HEAD = Path(__file__).resolve().parents[2] / "heads" / "smollm2-135m-instruct"


def default_head_path() -> Path:
    """The head `method: "eagle3"` uses when it names none (the target is the default model)."""
    if not (SHIPPED_HEAD / "config.json").is_file():
        raise ModelLoadError(
            f"speculative_config.model: no EAGLE-3 head is shipped in {SHIPPED_HEAD}; name one"
        )
    return SHIPPED_HEAD


def load_eagle3_head(
    path: str | Path,
    target_config: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    target_embedding: nn.Embedding | None = None,
) -> Eagle3Head:
    """The head in `path`, checked against the target it drafts for. The token embedding is the
    checkpoint's `embed_tokens.weight` if it has one, else `target_embedding` (shared). With
    device "meta" only names and shapes are checked (no tensor data is read)."""
    path = Path(path).expanduser()
    if not path.exists() and looks_like_hub_id(str(path)):
        try:  # a hub id (e.g. an `org/EAGLE3-...` head) in the local Hugging Face cache
            path = resolve_hub_id(str(path))
        except ModelLoadError as e:
            raise ModelLoadError(f"speculative_config.model: {e}") from None
    if not path.is_dir():
        raise ModelLoadError(
            f"speculative_config.model: EAGLE-3 head folder {str(path)!r} does not exist"
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"EAGLE-3 head {path} has no config.json")
    cfg = Eagle3Config.from_dict(read_json(path / "config.json"))
    tc = target_config
    if cfg.vocab_size != tc.vocab_size:
        raise ModelLoadError(
            f"EAGLE-3 head config vocab_size={cfg.vocab_size}, the target's is {tc.vocab_size}"
        )
    field = "target_hidden_size" if cfg.target_hidden_size is not None else "hidden_size"
    if (cfg.target_hidden_size or cfg.hidden_size) != tc.hidden_size:
        raise ModelLoadError(
            f"EAGLE-3 head config {field}={getattr(cfg, field)}, the target's hidden_size is "
            f"{tc.hidden_size}"
        )
    cfg.layer_ids(tc.num_hidden_layers)  # raises on ids outside the target
    meta = torch.device(device).type == "meta"
    tensors = _read_tensors(path, meta)
    has_embed = "embed_tokens.weight" in tensors
    if not has_embed:
        if target_embedding is None:
            raise ModelLoadError(f"EAGLE-3 head {path} lacks tensor 'embed_tokens.weight'")
        if target_embedding.weight.shape[1] != cfg.hidden_size:
            raise ModelLoadError(
                f"EAGLE-3 head {path} lacks tensor 'embed_tokens.weight' and its hidden_size "
                f"{cfg.hidden_size} differs from the target's {tc.hidden_size}: it cannot share "
                "the target's embedding"
            )
    with_conf = any(n in tensors for n in _CONFIDENCE)
    with torch.device("meta"):
        head = Eagle3Head(cfg, None if has_embed else target_embedding, with_conf).to(dtype)
    expected = head.state_dict()
    optional = set(_CONFIDENCE)
    if cfg.draft_vocab_size == cfg.vocab_size:
        optional |= {"d2t", "t2d"}  # identity mapping (vLLM and SGLang take none as identity)
    for name, param in expected.items():
        got = tensors.get(name)
        if got is None:
            if name in optional and not name.startswith("confidence_head."):
                continue
            raise ModelLoadError(f"EAGLE-3 head {path} lacks tensor {name!r}")
        if tuple(got.shape) != tuple(param.shape):
            raise ModelLoadError(
                f"EAGLE-3 head {path}: tensor {name!r} has shape {tuple(got.shape)}, expected "
                f"{tuple(param.shape)} (from config.json)"
            )
    unknown = sorted(n for n in tensors if n not in expected and "rotary_emb" not in n)
    if unknown:
        raise ModelLoadError(f"EAGLE-3 head {path}: unexpected tensor {unknown[0]!r}")
    if meta:
        return head
    head.to_empty(device=device)
    with torch.no_grad():
        for name, dst in head.state_dict().items():
            if name in tensors:
                dst.copy_(tensors[name].to(dst.dtype))
            elif name == "d2t":
                dst.zero_()
            elif name == "t2d":
                dst.fill_(True)
    _check_vocab_map(head, path)
    return head.eval()


def _check_vocab_map(head: Eagle3Head, path: Path) -> None:
    ids = head.draft_to_target().cpu()
    vocab = head.config.vocab_size
    if bool((ids < 0).any()) or bool((ids >= vocab).any()):
        raise ModelLoadError(f"EAGLE-3 head {path}: tensor 'd2t' maps draft ids outside 0..{vocab}")
    if ids.unique().numel() != ids.numel():
        raise ModelLoadError(f"EAGLE-3 head {path}: tensor 'd2t' maps two draft ids to one token")
    if int(head.t2d.sum()) != head.config.draft_vocab_size or not bool(head.t2d.cpu()[ids].all()):
        raise ModelLoadError(
            f"EAGLE-3 head {path}: tensor 't2d' does not mark exactly the targets of 'd2t'"
        )


def save_eagle3_head(head: Eagle3Head, config: Eagle3Config | None, path: str | Path) -> None:
    """Write `head` so vLLM, SGLang and load_eagle3_head read it (module docstring)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = config or head.config
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    conf = {k: state.pop(k) for k in _CONFIDENCE if k in state}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {
        "metadata": {"total_size": total},
        "weight_map": dict.fromkeys(state, "model.safetensors"),
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if conf:
        save_file(conf, str(path / CONFIDENCE_FILE), metadata={"format": "pt"})
    else:
        (path / CONFIDENCE_FILE).unlink(missing_ok=True)
    cfg = config.to_dict()
    cfg["torch_dtype"] = str(state["fc.weight"].dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
