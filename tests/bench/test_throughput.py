"""`bench throughput` end to end on a fake engine (and a tiny random HF model as the baseline)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from specserve.bench import hf_baseline, throughput
from specserve.bench.datasets import random_requests
from specserve.bench.report import RunResult, format_table
from specserve.bench.throughput import ThroughputSettings, run_throughput
from specserve.cli.bench import add_bench_parser, main, settings_from_args
from specserve.model.config import ModelConfig

TINY = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=1000,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    eos_token_ids=[0],
)


@pytest.fixture(autouse=True)
def one_torch_thread():
    # The tiny HF model's matmuls are microseconds of work; with OpenMP threads on a shared
    # 2-core machine, spin-waiting makes each one take tens of ms. One thread keeps this fast.
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@dataclass
class _Completion:
    token_ids: list[int]
    text: str = ""
    finish_reason: str = "length"


@dataclass
class _Out:
    prompt_token_ids: list[int]
    outputs: list[_Completion]
    metrics: Any


@dataclass
class FakeLLM:
    """Speaks the LLM API the benchmark uses; 'drafts' 3 tokens per step, 2 accepted."""

    tokenizer: Any
    model_name: str = "fake-model"
    calls: list[int] = field(default_factory=list)
    counters: dict[str, int] = field(
        default_factory=lambda: {
            "spec_drafts": 0,
            "spec_draft_tokens": 0,
            "spec_accepted_tokens": 0,
        }
    )

    def __post_init__(self) -> None:
        self.engine = SimpleNamespace(
            model_config=TINY, dtype=torch.float32, device=torch.device("cpu")
        )

    def generate(self, prompts, sampling_params, use_tqdm: bool = True):
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params] * len(prompts)
        )
        self.calls.append(len(prompts))
        outs = []
        for p, sp in zip(prompts, params):
            assert isinstance(p, list) and sp.temperature == 0.0
            t0 = time.perf_counter()
            n = sp.max_tokens
            m = SimpleNamespace(
                arrival_time=t0,
                first_token_time=t0 + 0.001,
                finished_time=t0 + 0.001 + 0.002 * (n - 1),  # 500 tok/s decode
                num_prompt_tokens=len(p),
                num_output_tokens=n,
            )
            outs.append(_Out(p, [_Completion(list(range(n)))], m))
            self.counters["spec_drafts"] += n
            self.counters["spec_draft_tokens"] += 3 * n
            self.counters["spec_accepted_tokens"] += 2 * n
        return outs

    def get_metrics(self) -> dict[str, Any]:
        return dict(self.counters, spec_acceptance_per_position=[0.9, 0.7, 0.4])


def _settings(tmp_path, **kw) -> ThroughputSettings:
    base = dict(
        model="dummy:tiny",
        dataset="random",
        num_prompts=3,
        max_tokens=6,
        input_len=5,
        ignore_eos=True,
        json_path=str(tmp_path / "r.json"),
        plot_path=str(tmp_path / "r.png"),
    )
    base.update(kw)
    return ThroughputSettings(**base)


@pytest.mark.parametrize("batch_1", [False, True])
def test_report_with_hf_baseline(tmp_path, word_tokenizer, batch_1, capsys):
    s = _settings(tmp_path, baseline="hf", batch_1=batch_1)
    llm = FakeLLM(word_tokenizer)
    report = run_throughput(s, llm=llm)
    assert llm.calls == ([1, 1, 1, 1] if batch_1 else [1, 3])  # warm-up, then the requests
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved == json.loads(json.dumps(report, default=str))
    for key in (
        "settings",
        "hardware",
        "software",
        "specserve",
        "baseline",
        "ratio",
        "speculation",
    ):
        assert key in saved
    assert saved["settings"]["num_prompts"] == 3 and saved["settings"]["batch_1"] is batch_1
    assert saved["hardware"]["cpu_cores"] >= 1 and saved["software"]["torch"] == torch.__version__
    ours, base = saved["specserve"], saved["baseline"]
    for side in (ours, base):
        assert side["num_requests"] == 3 and side["output_tokens"] == 18
        assert side["prompt_tokens"] == 15 and side["seconds"] > 0
        assert side["output_tok_s"] == pytest.approx(18 / side["seconds"])
        assert side["mode"] == ("batch1" if batch_1 else "batched")
    assert base["name"] == "hf" and base["dtype"] == "float32"
    assert saved["ratio"]["output_tok_s"] == pytest.approx(
        ours["output_tok_s"] / base["output_tok_s"]
    )
    if batch_1:
        assert ours["per_request_decode_tok_s"] == pytest.approx([500.0] * 3)
        assert ours["median_decode_tok_s"] == pytest.approx(500.0)
        assert len(base["per_request_decode_tok_s"]) == 3 and base["median_decode_tok_s"] > 0
    spec = saved["speculation"]  # counters of the timed run only (warm-up subtracted)
    assert spec["spec_drafts"] == 18 and spec["spec_accepted_tokens"] == 36
    assert spec["acceptance_rate"] == pytest.approx(2 / 3)
    assert spec["mean_acceptance_length"] == pytest.approx(3.0)
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "specserve / hf" in printed and "speculation:" in printed


def test_report_without_baseline(tmp_path, word_tokenizer):
    s = _settings(tmp_path, dataset="humaneval", num_prompts=2, plot_path=None)
    report = run_throughput(s, llm=FakeLLM(word_tokenizer), verbose=False)
    assert report["baseline"] is None and report["ratio"] is None
    assert report["specserve"]["output_tokens"] == 12
    assert not (tmp_path / "r.png").exists()


def test_hf_batched_counts_eos(word_tokenizer):
    cfg = hf_baseline.hf_config_from_model_config(TINY)
    model = hf_baseline.load_hf_model("dummy:tiny", torch.float32, torch.device("cpu"), cfg)
    reqs = random_requests(5, (3, 9), 7, vocab_size=1000, seed=1)
    res = hf_baseline.run_hf_batched(model, reqs, ignore_eos=True, batch_size=2)
    assert (res.output_tokens, res.batch_size, res.mode) == (35, 2, "batched")
    # left padding must not change a greedy continuation: batched == one at a time
    eos = hf_baseline._eos_ids(model, None)
    one = [
        hf_baseline._generate_batch(model, [r], 7, True, 0, torch.device("cpu")) for r in reqs[:2]
    ]
    two = hf_baseline._generate_batch(model, reqs[:2], 7, True, 0, torch.device("cpu"))
    assert [o[0] for o in one] == two
    assert eos == {0}


def test_count_output():
    count = hf_baseline._count_output
    assert count([5, 6, 2, 2, 2], 5, {2}, ignore_eos=False) == 3  # EOS counted, padding not
    assert count([5, 6, 2, 2, 2], 5, {2}, ignore_eos=True) == 5
    assert count([5, 6, 7, 8], 2, {2}, ignore_eos=False) == 2  # capped at the request's length


def test_format_table_ratio_row():
    a = RunResult("specserve", "batched", 4, 40, 100, 2.0)
    b = RunResult("hf", "batched", 4, 40, 100, 5.0)
    text = format_table([a, b], b)
    assert text.splitlines()[-1].split()[-2:] == ["2.50x", "2.50x"]


def test_cli_parses_into_settings(tmp_path):
    parser = argparse.ArgumentParser(prog="specserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["bench", "throughput", "--dataset", "humaneval", "--num-prompts", "8", "--batch-1"]
        + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
        + ["--baseline", "hf", "--dtype", "float32", "--json", str(tmp_path / "x.json")]
        + ["--no-prefix-caching"]
    )
    assert args.func.__name__ == "run_bench"
    s = settings_from_args(args)
    assert s.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    assert (s.dataset, s.num_prompts, s.batch_1, s.baseline) == ("humaneval", 8, True, "hf")
    assert (s.dtype, s.max_tokens, s.json_path) == ("float32", 128, str(tmp_path / "x.json"))
    assert s.enable_prefix_caching is False


def test_cli_runs_end_to_end(tmp_path, monkeypatch, word_tokenizer):
    monkeypatch.setattr(throughput, "make_llm", lambda s: FakeLLM(word_tokenizer))
    out = tmp_path / "cli.json"
    rc = main(
        ["throughput", "--dataset", "random", "--num-prompts", "2", "--max-tokens", "4"]
        + ["--ignore-eos", "--json", str(out)]
    )
    assert rc == 0
    assert json.loads(out.read_text())["specserve"]["output_tokens"] == 8


def _real_llm_available() -> bool:
    try:
        from specserve import LLM  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _real_llm_available(), reason="specserve.LLM not importable yet")
def test_real_engine_dummy_tiny_vs_hf(tmp_path):
    """The real engine on the tiny random preset, 2 prompts x 8 tokens, with the HF baseline."""
    s = _settings(tmp_path, model="dummy:tiny", num_prompts=2, max_tokens=8, plot_path=None)
    s.baseline = "hf"
    report = run_throughput(s, verbose=False)
    ours, base = report["specserve"], report["baseline"]
    assert report["model"] == "dummy:tiny"
    assert ours["output_tokens"] == base["output_tokens"] == 16
    assert ours["prompt_tokens"] == base["prompt_tokens"] == 10
    assert ours["dtype"] == base["dtype"] == "float32"
    assert report["ratio"]["output_tok_s"] > 0
    assert "spec_drafts" in report["engine_metrics"]
    assert ours["cached_prompt_tokens"] == 0  # distinct random prompts, warm-up under a block
