"""Operational endpoints, /metrics contents, the CLI parsers and a small `bench serve` run."""

from __future__ import annotations

import json

import httpx

from specserve import __version__
from specserve.bench.serve import ServeBenchSettings, run_serve_bench
from specserve.server.metrics import parse_prometheus, sample
from tests.server.conftest import Served


def test_health_version_models(tiny: Served):
    assert httpx.get(tiny.url + "/health").status_code == 200
    assert httpx.get(tiny.url + "/version").json() == {"version": __version__}
    models = httpx.get(tiny.url + "/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == tiny.model
    assert models["data"][0]["max_model_len"] == 2048


def test_metrics_count_requests_and_tokens(tiny: Served):
    before = parse_prometheus(tiny.metrics())
    client = tiny.openai()
    for _ in range(3):
        client.completions.create(
            model=tiny.model, prompt="count me", max_tokens=5, extra_body={"ignore_eos": True}
        )
    resp = httpx.get(tiny.url + "/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    after = parse_prometheus(resp.text)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("request_success_total", finished_reason="length") == 3
    assert delta("generation_tokens_total") == 15
    assert delta("prompt_tokens_total") == 3 * len(tiny.llm.tokenizer.encode("count me"))
    assert delta("time_to_first_token_seconds_count") == 3
    assert delta("e2e_request_latency_seconds_count") == 3
    assert delta("inter_token_latency_seconds_count") == 3 * 4
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "spec_decode_num_drafts_total", "spec_decode_num_accepted_tokens_total"):  # fmt: skip
        assert any(k.startswith("specserve:" + name) for k in after), name
    # histogram buckets are cumulative and end at the count
    buckets = [
        v for k, v in after.items() if k.startswith("specserve:time_to_first_token_seconds_bucket")
    ]
    assert buckets == sorted(buckets) and buckets[-1] == sample(
        after, "time_to_first_token_seconds_count"
    )


def test_cli_registers_serve_and_bench_serve():
    import argparse

    from specserve.bench.serve import add_serve_bench, cmd_serve_bench
    from specserve.cli.main import build_parser

    args = build_parser().parse_args(["serve", "dummy:tiny", "--port", "9999", "--api-key", "k"])
    got = (args.model_tag, args.port, args.api_key, args.host)
    assert got == ("dummy:tiny", 9999, "k", "127.0.0.1")
    # as the bench CLI will register it: its own func wins over the `bench` parser's default
    top = argparse.ArgumentParser()
    bench = top.add_subparsers(dest="command").add_parser("bench")
    add_serve_bench(bench.add_subparsers(dest="bench_command"))
    bench.set_defaults(func=print)
    parsed = top.parse_args(["bench", "serve", "--request-rate", "4", "--max-concurrency", "8"])
    assert (parsed.request_rate, parsed.max_concurrency) == (4.0, 8)
    assert parsed.func is cmd_serve_bench


def test_bench_serve_small_run(tiny: Served, tmp_path):
    s = ServeBenchSettings(
        base_url=tiny.url,
        dataset="random",
        num_prompts=8,
        input_len=32,
        output_len=8,
        ignore_eos=True,
        request_rate=50.0,
        max_concurrency=4,
        json_path=str(tmp_path / "bench.json"),
        plot_path=str(tmp_path / "bench.png"),
    )
    report = run_serve_bench(s)
    assert report["completed"] == 8 and report["failed"] == 0
    assert report["total_output_tokens"] == 64
    assert report["ttft_ms"]["p99"] >= report["ttft_ms"]["median"] > 0
    assert report["tpot_ms"] and report["itl_ms"] and report["e2el_ms"]
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["completed"] == 8
    assert (tmp_path / "bench.png").stat().st_size > 1000
