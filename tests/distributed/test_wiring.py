"""tensor_parallel_size reaches the engine from every entry point: CLI flag, serve flag, and one
real `specserve generate -tp 2` run (its worker gone when the command returns)."""

from __future__ import annotations

import pytest

from specserve.cli.main import build_parser, engine_config, main


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "hi", "--tensor-parallel-size", "2"],
        ["chat", "-tp", "2"],
        ["serve", "dummy:tiny", "-tp", "2"],
    ],
)
def test_flag_reaches_the_engine_config(argv: list[str]) -> None:
    if argv[0] == "serve":
        pytest.importorskip("fastapi")
    args = build_parser().parse_args([*argv, "--device", "cpu"])
    assert engine_config(args).tensor_parallel_size == 2


def test_generate_runs_at_tp2(capsys: pytest.CaptureFixture[str]) -> None:
    import multiprocessing

    argv = ["generate", "one two three", "--model", "dummy:tiny", "--device", "cpu", "-tp", "2"]
    assert main([*argv, "--max-tokens", "4", "--temperature", "0"]) == 0
    assert "[finish_reason=length]" in capsys.readouterr().err
    # the engine died with the command's LLM; its worker with it (finalizer or gc)
    import gc

    gc.collect()
    assert multiprocessing.active_children() == []
