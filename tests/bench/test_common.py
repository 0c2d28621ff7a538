"""Helpers shared by the speculation benchmarks."""

import sys

from specserve.bench.common import command_line, digest, engine_kwargs, golden_continuations


def test_golden_continuations_are_seeded_and_in_range():
    a = golden_continuations(3, 50, 100, seed="0:4")
    assert a == golden_continuations(3, 50, 100, seed="0:4")
    assert a != golden_continuations(3, 50, 100, seed="0:5")
    assert all(len(g) == 50 and all(1 <= t < 100 for t in g) for g in a)
    assert digest(a) == digest([list(g) for g in a]) != digest(a[::-1])


def test_command_line_names_the_module(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/x/specserve/cli/main.py", "bench", "plot", "a b.json"])
    assert command_line() == "python -m specserve.cli.main bench plot 'a b.json'"
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/specserve", "bench"])
    assert command_line() == "specserve bench"


def test_engine_kwargs_pass_only_what_was_set():
    assert engine_kwargs(None, None, False) == {}
    assert engine_kwargs(1024, 20.0, True, False) == {
        "max_model_len": 1024,
        "kv_cache_memory_gb": 20.0,
        "enforce_eager": True,
        "enable_prefix_caching": False,
    }
