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

    before = set(multiprocessing.active_children())
    argv = ["generate", "one two three", "--model", "dummy:tiny", "--device", "cpu", "-tp", "2"]
    assert main([*argv, "--max-tokens", "4", "--temperature", "0"]) == 0
    assert "[finish_reason=length]" in capsys.readouterr().err
    # the engine died with the command's LLM; its worker with it (finalizer or gc)
    import gc

    gc.collect()
    assert set(multiprocessing.active_children()) - before == set()


def test_server_engine_thread_ends_on_a_worker_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead worker is not one failed batch: the engine thread stops and reports unhealthy
    (the server's /health turns 503) instead of failing each new request forever."""
    pytest.importorskip("fastapi")
    import time

    from specserve import LLM, SamplingParams
    from specserve.distributed import TensorParallelError
    from specserve.server.async_engine import AsyncEngine

    eng = LLM("dummy:tiny", device="cpu", dtype="float32", progress=False).engine

    def dead_step() -> list:
        raise TensorParallelError("tensor-parallel worker rank 1 (pid 1) was killed by SIGKILL")

    monkeypatch.setattr(eng, "step", dead_step)
    client = AsyncEngine(eng)
    try:
        assert client.alive
        client.call_sync(lambda e: e.add_request("hi", SamplingParams(max_tokens=4)), timeout=30)
        deadline = time.monotonic() + 10
        while client.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not client.alive
        assert isinstance(client.dead, TensorParallelError)
    finally:
        client.shutdown()
