"""Build a C++ kernel source of this package into a shared library and load it with ctypes.

Compiled with the system compiler ($CXX, else c++/g++/clang++) into $SPECSERVE_CACHE/kernels/,
keyed by a hash of the source, the compiler, the flags and the CPU (a shared cache may serve
machines of other CPUs: -march=native depends on them). Plain C ABIs: no torch headers, no
ninja, about a second a file. `-fopenmp` links libgomp.so.1, which resolves to the copy torch
already loaded, so kernels share torch's OpenMP thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from specserve import env

logger = logging.getLogger(__name__)

# -fno-trapping-math: lets loops with a clamp before a float-to-int conversion vectorise
# (cpu_math.h's exp); it changes no result.
_COMMON = ["-O3", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared", "-std=c++17"]
FLAG_SETS = (
    ["-march=native", *_COMMON],
    _COMMON,  # a compiler without -march=native
)


def cpu_id() -> str:
    """What -march=native depends on."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _source_text(source: Path) -> str:
    """The source and the local headers it includes (`#include "x.h"` beside it): the cache key."""
    text = source.read_text()
    headers = re.findall(r'^#include "([^"]+)"', text, flags=re.MULTILINE)
    return "\0".join([text, *((source.parent / h).read_text() for h in sorted(headers))])


def build(source: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile `source` (or find it built) and return the shared library's path."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, c++, g++, clang++)")
    key = hashlib.sha256(
        "\0".join([_source_text(source), cxx, cpu_id(), str(FLAG_SETS), str(extra_flags)]).encode()
    )
    out_dir = env.settings.cache_dir / "kernels"
    lib = out_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in FLAG_SETS:
        # a private name, then an atomic rename: concurrent builders never see half a file
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        proc = subprocess.run(
            [cxx, *flags, *extra_flags, str(source), "-o", tmp],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode == 0:
            os.replace(tmp, lib)
            return lib
        os.unlink(tmp)
        errors.append(f"{' '.join(flags)}: {proc.stderr.strip()[-2000:]}")
    raise RuntimeError(f"compiling {source.name} failed:\n" + "\n".join(errors))


def load(source: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    return ctypes.CDLL(str(build(source, extra_flags)))


class LazyKernel:
    """A kernel library built and loaded on first use; `get()` is None (after one warning)
    where it cannot be built, and the caller keeps its other path. `setup` checks the ABI
    version and declares argument types."""

    def __init__(
        self,
        source: Path,
        setup: Callable[[ctypes.CDLL], None],
        fallback: str,
        extra_flags: tuple[str, ...] = (),
    ) -> None:
        self.source, self.setup, self.fallback = source, setup, fallback
        self.extra_flags = extra_flags
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False

    def get(self) -> ctypes.CDLL | None:
        if not self._tried:
            with self._lock:
                if not self._tried:
                    try:
                        lib = load(self.source, self.extra_flags)
                        self.setup(lib)
                        self._lib = lib
                    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                        logger.warning(
                            "%s unavailable, using %s: %s",
                            self.source.name,
                            self.fallback,
                            str(e).splitlines()[0],
                        )
                    self._tried = True
        return self._lib
