"""`--baseline hf-cb`: HF's continuous batching (`model.generate_batch`) on a tiny random Llama,
checked against `model.generate`, and flowing through `bench throughput` like `--baseline hf`."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest
import torch

from specserve.bench import hf_baseline, hf_continuous
from specserve.bench.datasets import BenchRequest
from specserve.bench.throughput import run_throughput
from specserve.cli.bench import add_bench_parser, settings_from_args
from tests.bench.test_throughput import TINY, FakeLLM, _settings

pytestmark = pytest.mark.usefixtures("single_thread")

CPU = torch.device("cpu")
# generate_batch sizes its KV cache and per-step buffers from free memory; on the host those
# defaults made one tiny call take ~17 s (mostly clearing buffers), so the tests pin small sizes
_CB_CONFIG = hf_continuous.cb_config  # the real one, for the stand-in the tests patch in


def _small_cb_config(max_batch_tokens: int | None = None, num_blocks: int | None = None) -> Any:
    return _CB_CONFIG(max_batch_tokens=64, num_blocks=4)


@pytest.fixture(scope="module")
def model() -> Any:
    """dummy:tiny with weights spread wide enough that greedy outputs vary (at the default init
    the tied embeddings make every step repeat the last prompt token: nothing to compare)."""
    cfg = hf_baseline.hf_config_from_model_config(TINY)
    m = hf_baseline.load_hf_model("dummy:tiny", torch.float32, CPU, cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.5)
    return m


def _requests(lengths: list[int], output_lens: list[int]) -> list[BenchRequest]:
    reqs = []
    for i, (n, out) in enumerate(zip(lengths, output_lens)):
        ids = [1 + (37 * i + 11 * j) % 997 for j in range(n)]
        reqs.append(BenchRequest(prompt="", prompt_token_ids=ids, output_len=out))
    return reqs


def _generate(model: Any, r: BenchRequest, max_new: int) -> list[int]:
    """model.generate, one request, no padding: the reference continuation."""
    return hf_baseline._generate_batch(model, [r], max_new, True, 0, CPU)[0]


def test_generate_batch_greedy_equals_generate(model):
    reqs = _requests([3, 9, 5], [8, 8, 8])
    gc = hf_continuous.cb_generation_config(model, 8, ignore_eos=True, eos={0})
    attn_before = model.config._attn_implementation
    got = hf_continuous.generate_batch_tokens(
        model, [r.prompt_token_ids for r in reqs], 8, gc, _small_cb_config()
    )
    want = [_generate(model, r, 8) for r in reqs]
    assert got == want
    assert any(len(set(g)) > 2 for g in got)  # real continuations, not one token repeated
    assert model.config._attn_implementation == attn_before  # generate_batch put it back


def test_ignore_eos_and_per_request_lengths(model, monkeypatch):
    reqs = _requests([4, 7, 2], [5, 9, 3])
    ref = [_generate(model, r, 9) for r in reqs]
    eos = ref[1][2]  # a token request 1 greedily produces third: it would stop there
    model.generation_config.eos_token_id = [eos]
    monkeypatch.setattr(hf_continuous, "cb_config", _small_cb_config)
    try:
        # ignore_eos: generate_batch itself must not stop on the EOS id (not just our counting)
        gc = hf_continuous.cb_generation_config(model, 9, ignore_eos=True, eos={eos})
        gens = hf_continuous.generate_batch_tokens(
            model, [r.prompt_token_ids for r in reqs], 9, gc, _small_cb_config()
        )
        assert gens == ref and eos in gens[1] and [len(g) for g in gens] == [9, 9, 9]

        res = hf_continuous.run_hf_continuous(model, reqs, ignore_eos=True)
        # one max_new_tokens for the call, each request counted up to its own output_len
        assert res.output_tokens == 5 + 9 + 3
        assert (res.name, res.mode, res.num_requests, res.prompt_tokens) == (
            "hf-cb",
            "continuous",
            3,
            13,
        )
        d = res.to_dict()
        assert d["attn_implementation"] and d["setup_seconds"] > 0 and res.seconds > 0
        assert d["max_batch_tokens"] == 64 and d["num_blocks"] == 4
        assert d["max_requests_per_batch"] == 3  # from the timed run's hints, not the warm-up's
        assert not hasattr(model, "_cached_continuous_batching_manager")  # cache released

        # without ignore_eos it stops on the EOS and counts it, as the other modes do
        stop = hf_continuous.run_hf_continuous(model, reqs, ignore_eos=False, warmup=False)
        want = sum(
            hf_baseline._count_output(g, r.output_len, {eos}, ignore_eos=False)
            for g, r in zip(ref, reqs)
        )
        assert stop.output_tokens == want < 17
    finally:
        model.generation_config.eos_token_id = [0]


def test_report_with_hf_cb_baseline(tmp_path, word_tokenizer, monkeypatch, capsys):
    monkeypatch.setattr(hf_continuous, "cb_config", _small_cb_config)
    s = _settings(tmp_path, baseline="hf-cb", plot_path=None)
    run_throughput(s, llm=FakeLLM(word_tokenizer))
    saved = json.loads((tmp_path / "r.json").read_text())
    base = saved["baseline"]
    assert (base["name"], base["mode"], base["output_tokens"]) == ("hf-cb", "continuous", 18)
    assert base["prompt_tokens"] == saved["specserve"]["prompt_tokens"] == 15
    assert saved["settings"]["baseline"] == "hf-cb"
    assert saved["ratio"]["output_tok_s"] == pytest.approx(
        saved["specserve"]["output_tok_s"] / base["output_tok_s"]
    )
    printed = capsys.readouterr().out
    assert "specserve / hf-cb" in printed and "generate_batch (continuous batching)" in printed


def test_cli_baseline_hf_cb(tmp_path):
    parser = argparse.ArgumentParser(prog="specserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "throughput", "--baseline", "hf-cb", "--ignore-eos"])
    assert settings_from_args(args).baseline == "hf-cb"
    with pytest.raises(ValueError, match="--batch-1"):
        settings_from_args(
            parser.parse_args(["bench", "throughput", "--baseline", "hf-cb", "--batch-1"])
        )
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "throughput", "--baseline", "vllm"])
