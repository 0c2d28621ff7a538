"""`bench plot`: throughput reports (specserve vs HF) into one PNG."""

from __future__ import annotations

import json

from specserve.bench.plot_results import comparison_from_report, load_comparisons, main, run_plot


def _report(mode: str, ours: float, base: float | None, **settings) -> dict:
    def side(name: str, rate: float) -> dict:
        return {
            "name": name,
            "mode": mode,
            "num_requests": 4,
            "batch_size": 1 if mode == "batch1" else 4,
            "output_tok_s": rate / 2,
            "median_decode_tok_s": rate if mode == "batch1" else None,
        }

    return {
        "benchmark": "throughput",
        "model": "dummy:tiny",
        "settings": {"dataset": "random", "input_len": 16, "max_tokens": 8} | settings,
        "hardware": {"cpu": "test CPU", "cpu_cores": 2},
        "specserve": side("specserve", ours),
        "baseline": side("hf", base) if base is not None else None,
    }


def test_batch1_compares_median_decode_and_batched_output_rate():
    c = comparison_from_report(_report("batch1", 150.0, 50.0))
    assert (c.ours, c.baseline, c.ratio) == (150.0, 50.0, 3.0)
    assert "decode" in c.metric and "batch 1" in c.label and "random weights" in c.label
    c = comparison_from_report(_report("batched", 800.0, 100.0))
    assert (c.ours, c.baseline) == (400.0, 50.0) and c.metric == "output tok/s"
    assert comparison_from_report(_report("batched", 8.0, None)).ratio is None


def test_other_reports_are_skipped(tmp_path):
    good, other, broken = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    good.write_text(json.dumps(_report("batched", 10.0, 5.0)))
    other.write_text(json.dumps({"benchmark": "spec-sweep", "points": []}))
    broken.write_text("{")
    comps, skipped = load_comparisons([str(good), str(other), str(broken)])
    assert len(comps) == 1 and len(skipped) == 2
    assert main([str(other), "--out", str(tmp_path / "none.png")]) == 1
    assert not (tmp_path / "none.png").exists()


def test_plot_of_several_reports(tmp_path, capsys):
    reports = [
        _report("batch1", 225.0, 45.8),
        _report("batch1", 930.0, 47.6),
        _report("batched", 29944.0, 1764.8),
    ]
    paths = []
    for i, rep in enumerate(reports):
        rep["ratio"] = {
            "median_decode_tok_s": (rep["specserve"]["median_decode_tok_s"] or 0)
            / (rep["baseline"]["median_decode_tok_s"] or 1),
            "output_tok_s": rep["specserve"]["output_tok_s"] / rep["baseline"]["output_tok_s"],
        }
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(rep))
    out = tmp_path / "vs_hf.png"
    comps = run_plot([str(p) for p in paths], str(out))
    assert [round(c.ratio, 2) for c in comps] == [
        round(json.loads(p.read_text())["ratio"][key], 2)
        for p, key in zip(paths, ["median_decode_tok_s", "median_decode_tok_s", "output_tok_s"])
    ]
    assert out.stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert all(f"{c.ratio:.2f}x" in printed for c in comps)


def test_cli_subcommand(tmp_path):
    from specserve.cli.bench import main as bench_main

    report = tmp_path / "r.json"
    report.write_text(json.dumps(_report("batch1", 30.0, 10.0)))
    out = tmp_path / "sub" / "plot.png"
    assert bench_main(["plot", str(report), "--out", str(out), "--title", "t"]) == 0
    assert out.stat().st_size > 0
