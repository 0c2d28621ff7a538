"""Hub ids (`Qwen/Qwen2.5-0.5B-Instruct`) resolved from the local Hugging Face cache, never a
download.

The cache is the one huggingface_hub writes: <cache>/models--<org>--<name>/ holds
refs/<branch-or-tag> (a file with a commit hash) and snapshots/<commit>/ (the repository's files,
usually symlinks into blobs/). The cache folder is $HF_HUB_CACHE, else $HF_HOME/hub, else
$XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from specserve.model.errors import ModelLoadError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps models on this machine (its own order of precedence)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):  # the second: its legacy name
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def looks_like_hub_id(model: str) -> bool:
    """`org/name` or `name`: what a hub id may look like (a path that exists is a path)."""
    return bool(_HUB_ID.match(model)) and ".." not in model


def resolve_hub_id(model: str, revision: str | None = None) -> Path:
    """The snapshot folder of `model` at `revision` (default: main) in the local HF cache.
    ModelLoadError, naming every place looked at, when it is not there."""
    repo = hub_cache_dir() / f"models--{model.replace('/', '--')}"
    looked = [str(repo)]
    if repo.is_dir():
        looked.clear()
        snapshot = _snapshot(repo, revision or "main", revision is None, looked)
        if snapshot is not None:
            return snapshot
    where = "; ".join(looked)
    raise ModelLoadError(
        f"model {model!r}{'' if revision is None else f' (revision {revision!r})'} is neither a "
        f"local path nor in the Hugging Face cache (looked in {where}). specserve never "
        "downloads: fetch it first (e.g. `huggingface-cli download "
        f"{model}`), point HF_HUB_CACHE / HF_HOME at the cache holding it, or pass a folder"
    )


def _snapshot(repo: Path, rev: str, rev_is_default: bool, looked: list[str]) -> Path | None:
    snapshots = repo / "snapshots"
    ref = repo / "refs" / rev
    if ref.is_file():
        commit = ref.read_text().strip()
        path = snapshots / commit
        if path.is_dir():
            return path
        looked.append(f"{path} (named by {ref})")
        return None
    if _COMMIT.match(rev) and (snapshots / rev).is_dir():
        return snapshots / rev
    # a cache copied by hand may lack refs/: with the default revision one snapshot is unambiguous
    found = sorted(p for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
    if rev_is_default and len(found) == 1:
        return found[0]
    have = ", ".join(p.name for p in found) or "none"
    looked.append(f"{ref} or {snapshots / rev} (snapshots there: {have})")
    return None
