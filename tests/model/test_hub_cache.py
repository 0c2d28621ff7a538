"""Hub ids resolve from a local Hugging Face cache laid out as huggingface_hub writes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specserve.model.errors import ModelLoadError
from specserve.model.loader import load_model, resolve_model_path

CPU = torch.device("cpu")
MAIN = "a" * 40
OTHER = "b" * 40


def _snapshot(cache: Path, repo: str, commit: str, src: Path, ref: str | None = "main") -> Path:
    """A snapshot of `src` as huggingface_hub stores it: files are symlinks into blobs/."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for f in src.iterdir():
        blob = root / "blobs" / f"{commit[:8]}-{f.name}"
        blob.write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(blob)
    if ref is not None:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_hub_id_loads_from_the_cache(hub: Path, tiny_llama_dir: Path) -> None:
    snap = _snapshot(hub, "org/tiny", MAIN, tiny_llama_dir)
    assert resolve_model_path("org/tiny") == snap
    loaded = load_model("org/tiny", torch.float32, CPU, progress=False)
    direct = load_model(str(tiny_llama_dir), torch.float32, CPU, progress=False)
    assert loaded.name == "org/tiny" and loaded.config == direct.config
    for (n, a), (_, b) in zip(loaded.model.named_parameters(), direct.model.named_parameters()):
        assert torch.equal(a, b), n


def test_revisions_select_snapshots(hub: Path, tiny_llama_dir: Path) -> None:
    main = _snapshot(hub, "org/tiny", MAIN, tiny_llama_dir)
    other = _snapshot(hub, "org/tiny", OTHER, tiny_llama_dir, ref="v2")
    assert resolve_model_path("org/tiny") == main
    assert resolve_model_path("org/tiny", revision="main") == main
    assert resolve_model_path("org/tiny", revision="v2") == other  # a tag or branch
    assert resolve_model_path("org/tiny", revision=OTHER) == other  # a commit
    with pytest.raises(ModelLoadError, match="revision 'v3'") as e:
        resolve_model_path("org/tiny", revision="v3")
    assert MAIN in str(e.value) and OTHER in str(e.value)  # says which snapshots exist


def test_without_refs_only_a_single_snapshot_is_taken(hub: Path, tiny_llama_dir: Path) -> None:
    one = _snapshot(hub, "org/a", MAIN, tiny_llama_dir, ref=None)
    assert resolve_model_path("org/a") == one
    _snapshot(hub, "org/b", MAIN, tiny_llama_dir, ref=None)
    _snapshot(hub, "org/b", OTHER, tiny_llama_dir, ref=None)
    with pytest.raises(ModelLoadError, match="refs"):
        resolve_model_path("org/b")


@pytest.mark.parametrize("layout", ["HF_HOME", "XDG_CACHE_HOME", "HOME"])
def test_cache_location_follows_huggingface_hub(
    layout: str, hub: Path, tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_CACHE")
    base = tmp_path / "base"
    monkeypatch.setenv(layout, str(base))
    cache = {
        "HF_HOME": base / "hub",
        "XDG_CACHE_HOME": base / "huggingface" / "hub",
        "HOME": base / ".cache" / "huggingface" / "hub",
    }[layout]
    snap = _snapshot(cache, "org/tiny", MAIN, tiny_llama_dir)
    assert resolve_model_path("org/tiny") == snap


def test_missing_hub_id_says_where_it_looked(hub: Path) -> None:
    with pytest.raises(ModelLoadError) as e:
        load_model("Qwen/Qwen2.5-0.5B-Instruct", torch.float32, CPU)
    msg = str(e.value)
    assert str(hub / "models--Qwen--Qwen2.5-0.5B-Instruct") in msg and "never downloads" in msg


def test_snapshot_without_weights_is_a_clear_error(hub: Path, tiny_llama_dir: Path) -> None:
    snap = _snapshot(hub, "org/tiny", MAIN, tiny_llama_dir)
    (snap / "model.safetensors").unlink()  # an interrupted download
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model("org/tiny", torch.float32, CPU, progress=False)


def test_revision_of_a_local_folder_is_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="revision"):
        load_model(str(tiny_llama_dir), torch.float32, CPU, revision="main")


def test_tokenizer_from_a_hub_id(hub: Path, tiny_llama_dir: Path, tmp_path: Path) -> None:
    tok_only = tmp_path / "tok"
    tok_only.mkdir()
    for f in tiny_llama_dir.iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            (tok_only / f.name).write_bytes(f.read_bytes())
    snap = _snapshot(hub, "org/tok", MAIN, tok_only)
    loaded = load_model("dummy:tiny", torch.float32, CPU, progress=False, tokenizer="org/tok")
    assert Path(loaded.tokenizer.name_or_path) == snap  # this tokenizer, not the default one
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("hello world")).strip() == "hello world"
    with pytest.raises(ModelLoadError, match="org/none"):
        load_model("dummy:tiny", torch.float32, CPU, tokenizer="org/none")


def test_remote_code_architectures_are_refused(tmp_path: Path) -> None:
    cfg = {"architectures": ["FancyForCausalLM"], "auto_map": {"AutoModel": "modeling.Fancy"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="never runs remote code"):
        load_model(str(tmp_path), torch.float32, CPU)
