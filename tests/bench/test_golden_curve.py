"""`bench golden-curve`: speedup vs acceptance rate with golden drafts, on dummy:tiny (CPU)."""

from __future__ import annotations

import argparse
import json

import pytest

from specserve.bench.golden_curve import (
    CurvePoint,
    CurveSettings,
    expected_acceptance_length,
    format_curve_table,
    run_golden_curve,
    settings_from_args,
)
from specserve.cli.bench import add_bench_parser

pytestmark = pytest.mark.usefixtures("single_thread")

K = 4
MAX_TOKENS = 1 + 2 * (K + 1)  # first token from the prefill, then two full verify steps


def _settings(tmp_path, **kw) -> CurveSettings:
    base = dict(
        model="dummy:tiny",
        k=K,
        acceptance_rates=[0.0, 1.0],
        batch_sizes=[1, 3],
        input_len=8,
        max_tokens=MAX_TOKENS,
        device="cpu",
        dtype="float32",
        max_model_len=64,
        json_path=str(tmp_path / "curve.json"),
        plot_path=str(tmp_path / "curve.png"),
    )
    return CurveSettings(**(base | kw))


def test_curve_dials_acceptance_and_emits_the_golden_tokens(tmp_path, capsys):
    report = run_golden_curve(_settings(tmp_path))
    pts = {(p["mode"], p["acceptance_rate"], p["batch_size"]): p for p in report["points"]}
    assert set(pts) == {
        (m, r, b) for m, r in [("off", None), ("fixed", 0.0), ("fixed", 1.0)] for b in (1, 3)
    }
    for b in (1, 3):
        off, never, always = pts[("off", None, b)], pts[("fixed", 0.0, b)], pts[("fixed", 1.0, b)]
        for p in (off, never, always):
            assert p["output_tokens"] == b * MAX_TOKENS
            assert p["outputs_match_golden"]
        assert off["speedup"] == pytest.approx(1.0)
        assert off["mean_acceptance_length"] == 1.0 and off["steps"] == MAX_TOKENS
        # every draft wrong: one token per step, as without speculation, but k rows verified
        assert never["mean_acceptance_length"] == 1.0 and never["steps"] == MAX_TOKENS
        assert never["acceptance_per_position"] == [0.0] * K
        assert never["draft_rows_per_step"] > 0
        # every draft right: k + 1 tokens per verify step
        assert always["mean_acceptance_length"] == pytest.approx(K + 1)
        assert always["expected_acceptance_length"] == K + 1
        assert always["acceptance_per_position"] == [1.0] * K
        assert always["steps"] == 3  # the prefill step + two verify steps
    assert report["checks"]["outputs_match_golden"]
    assert report["engines_built"] == 2  # off, and one golden engine re-dialled between rates
    saved = json.loads((tmp_path / "curve.json").read_text())
    for key in ("command", "settings", "hardware", "software", "points", "checks", "timestamp"):
        assert key in saved
    assert saved["settings"]["acceptance_rates"] == [0.0, 1.0]
    assert (tmp_path / "curve.png").stat().st_size > 0
    table = capsys.readouterr().out
    assert "speedup" in table and "5.00" in table


def test_auto_budget_and_fresh_engines(tmp_path):
    s = _settings(tmp_path, acceptance_rates=[0.5, 1.0], batch_sizes=[2], auto=True)
    s.fresh_engines, s.json_path, s.plot_path = True, None, None
    report = run_golden_curve(s, verbose=False)
    assert report["engines_built"] == 1 + 2 * 2  # off + (fixed, auto) x 2 rates
    modes = [(p["mode"], p["acceptance_rate"]) for p in report["points"]]
    assert modes == [("off", None), ("fixed", 0.5), ("fixed", 1.0), ("auto", 0.5), ("auto", 1.0)]
    assert report["checks"]["outputs_match_golden"]
    half = next(p for p in report["points"] if p["mode"] == "fixed" and p["acceptance_rate"] == 0.5)
    assert 1.0 <= half["mean_acceptance_length"] <= K + 1


def test_expected_acceptance_length():
    assert expected_acceptance_length(0.0, 4) == 1.0
    assert expected_acceptance_length(1.0, 4) == 5.0
    assert expected_acceptance_length(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_settings_are_checked():
    with pytest.raises(ValueError):
        CurveSettings(acceptance_rates=[1.5])
    with pytest.raises(ValueError):
        CurveSettings(batch_sizes=[])
    with pytest.raises(ValueError):
        CurveSettings(input_len=128, max_tokens=256, max_model_len=256)


def test_cli_parses_lists_into_settings():
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        "bench golden-curve --model dummy:llama-3.1-8b --acceptance-rates 0,0.5,1 "
        "--batch-sizes 1,16 --max-tokens 64 --auto --json x.json".split()
    )
    s = settings_from_args(args)
    assert s.acceptance_rates == [0.0, 0.5, 1.0] and s.batch_sizes == [1, 16]
    assert s.auto and s.k == 4 and s.max_tokens == 64 and s.json_path == "x.json"


def test_table_orders_off_first():
    def pt(mode, rate, speedup):
        return CurvePoint(mode, rate, 1, 10, 1.0, None, 10, 1.0, None, [], 0.0, True, speedup)

    text = format_curve_table([pt("fixed", 0.5, 1.5), pt("off", None, 1.0)])
    lines = text.splitlines()
    assert "off" in lines[1] and "fixed" in lines[2] and "1.50x" in lines[2]
