"""The `specserve` command line: a parser built without torch, help on every flag, --version,
and user errors as one line on stderr before any model loads."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

import specserve
from specserve.cli.main import build_parser, engine_config, main


def _options(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{path} {name}")
        else:
            yield path, action


def test_building_the_parser_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from specserve.cli.main import build_parser\n"
        "build_parser()\n"
        "heavy = [m for m in ('torch', 'transformers', 'numpy', 'fastapi') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_every_flag_has_help() -> None:
    missing = [
        f"{path} {a.option_strings or a.dest}"
        for path, a in _options(build_parser(), "specserve")
        if not a.help and not isinstance(a, argparse._HelpAction)
    ]
    assert not missing


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"specserve {specserve.__version__}"


def test_engine_flags_become_the_engine_config() -> None:
    args = build_parser().parse_args(
        [
            "generate",
            "hi",
            "--model",
            "dummy:tiny",
            "--tokenizer",
            "some/tok",
            "--revision",
            "v2",
            "--trust-remote-code",
            "--dtype",
            "half",
            "-tp",
            "1",
            "--no-enable-chunked-prefill",
            "--gpu-memory-utilization",
            "0.5",
            "--max-num-batched-tokens",
            "4096",
        ]
    )
    cfg = engine_config(args)
    assert (cfg.tokenizer, cfg.revision, cfg.trust_remote_code) == ("some/tok", "v2", True)
    assert cfg.dtype == "float16" and cfg.enable_chunked_prefill is False
    assert cfg.gpu_memory_utilization == 0.5 and cfg.max_num_batched_tokens == 4096
    default = engine_config(build_parser().parse_args(["generate", "hi"]))
    assert default.gpu_memory_utilization == 0.9 and default.enable_chunked_prefill is None


@pytest.fixture
def no_model_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reaching the engine fails the test: these errors must come before any model loads."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the engine was built")

    monkeypatch.setattr("specserve.llm.build_engine", refuse)
    monkeypatch.setattr("specserve.llm_engine.LLMEngine", refuse)


def _one_error_line(capsys: pytest.CaptureFixture[str], *words: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert "Traceback" not in err
    for w in words:
        assert w in err, err
    return err


BASE = ["--model", "dummy:tiny", "--device", "cpu"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["generate", "hi", "--temperature", "-1", *BASE], ["temperature"]),
        (["generate", "hi", "--top-p", "0", *BASE], ["top_p"]),
        (["generate", "hi", "--max-tokens", "0", *BASE], ["max_tokens"]),
        (["generate", "hi", "-tp", "0", *BASE], ["tensor_parallel_size must be"]),
        (["generate", "hi", "-q", "awq", *BASE], ["quantization"]),
        (["generate", "hi", "--gpu-memory-utilization", "1.5", *BASE], ["gpu_memory_utilization"]),
        (["generate", "hi", "--model", "dummy:tiny", "--device", "tpu"], ["device"]),
        (["generate", "--file", "/nonexistent/prompts.txt", *BASE], ["--file"]),
        (["chat", "--temperature", "-1", *BASE], ["temperature"]),
    ],
)
def test_user_errors_are_one_line_before_loading(
    argv: list[str],
    words: list[str],
    no_model_loading: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(argv) == 2
    _one_error_line(capsys, *words)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cuda_without_cuda(
    command: str, no_model_loading: None, capsys: pytest.CaptureFixture[str]
) -> None:
    if command == "serve":
        pytest.importorskip("fastapi")
    argv = [command, "--model", "dummy:tiny", "--device", "cuda"]
    assert main(argv + (["hi"] if command == "generate" else [])) == 2
    _one_error_line(capsys, "CUDA is not available")


def test_serve_refuses_bad_engine_flags_before_loading(
    no_model_loading: None, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("fastapi")
    assert main(["serve", "dummy:tiny", "--device", "cpu", "-tp", "0"]) == 2
    _one_error_line(capsys, "tensor_parallel_size")


def test_a_path_that_is_not_a_model(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("not weights")
    assert main(["generate", "hi", "--device", "cpu", "--model", str(tmp_path)]) == 2
    _one_error_line(capsys, "config.json")
    assert main(["generate", "hi", "--device", "cpu", "--model", str(tmp_path / "notes.txt")]) == 2
    _one_error_line(capsys, "neither a model folder nor a .gguf")
    assert main(["generate", "hi", "--device", "cpu", "--model", "org/not-cached"]) == 2
    _one_error_line(capsys, "models--org--not-cached", "never downloads")


def test_bench_serve_without_a_server(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("httpx")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}"]) == 1
    _one_error_line(capsys, f"127.0.0.1:{port}", "specserve serve")


def test_bench_throughput_passes_the_engine_flags() -> None:
    from specserve.cli.bench import settings_from_args

    args = build_parser().parse_args(
        [
            "bench",
            "throughput",
            "--tokenizer",
            "t",
            "--gpu-memory-utilization",
            "0.7",
            "--no-overlap",
        ]
    )
    s = settings_from_args(args)
    assert s.engine_args == {"tokenizer": "t", "gpu_memory_utilization": 0.7, "overlap": False}
    assert settings_from_args(build_parser().parse_args(["bench", "throughput"])).engine_args == {}
