"""Build .devcarry: what a GPU run carries to the device machine, which has no model hub, no
`gguf` package and a 64 MiB carry limit: the default model's tokenizer (dummy models use it) and
the ShareGPT pairs. On the device: SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer and
SPECSERVE_CACHE=$PWD/.devcarry/cache (see benchmarks/h200.sh).

    python tools/devcarry.py   (or: make devcarry)
"""

from __future__ import annotations

import shutil
from pathlib import Path

from specserve.bench.datasets import load_sharegpt_corpus
from specserve.model.loader import cache_dir, default_model_path, gguf_tokenizer_folder


def build(out: Path = Path(".devcarry")) -> None:
    shutil.copytree(
        gguf_tokenizer_folder(default_model_path()), out / "tokenizer", dirs_exist_ok=True
    )
    load_sharegpt_corpus()  # fetched and cached once
    (out / "cache").mkdir(parents=True, exist_ok=True)
    for path in cache_dir().glob("sharegpt_v3_pairs*"):
        shutil.copy(path, out / "cache")


if __name__ == "__main__":
    build()
