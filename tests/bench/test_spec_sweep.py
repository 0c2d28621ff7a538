"""The speculation sweep runs all three modes on the same prompts and checks the targets."""

import argparse

from specserve.bench.spec_sweep import SweepPoint, _checks, run_sweep


def test_checks_flag_a_point_where_auto_loses_to_off():
    pts = [
        SweepPoint("off", 1, 4, 100, 1.0, 1.0, 0.0),
        SweepPoint("fixed", 1, 4, 200, 1.0, 3.0, 3.0),
        SweepPoint("auto", 1, 4, 199, 1.0, 3.0, 3.0),
        SweepPoint("off", 8, 8, 100, 1.0, 1.0, 0.0),
        SweepPoint("fixed", 8, 8, 80, 1.0, 2.0, 3.0),
        SweepPoint("auto", 8, 8, 97, 1.0, 1.5, 1.0),
    ]
    checks = _checks(pts, [1, 8])
    assert not checks["all_ok"]  # at C=8 auto is 3% below off: more than the 2% allowed
    assert "C=1" in checks["lines"][0] and checks["lines"][0].endswith("ok")


def test_sweep_runs_end_to_end_on_a_tiny_model(tmp_path):
    args = argparse.Namespace(
        model="dummy:tiny",
        method="ngram",
        draft_model="self",
        k=2,
        dataset="humaneval",
        concurrency="1,2",
        requests_per_slot=1,
        min_requests=2,
        max_tokens=6,
        dtype="float32",
        device="cpu",
        seed=0,
        json_path=str(tmp_path / "sweep.json"),
        plot_path=str(tmp_path / "sweep.png"),
    )
    report = run_sweep(args)
    assert {(p["mode"], p["concurrency"]) for p in report["points"]} == {
        (m, c) for m in ("off", "fixed", "auto") for c in (1, 2)
    }
    assert all(p["output_tokens"] == p["requests"] * 6 for p in report["points"])
    assert (tmp_path / "sweep.png").stat().st_size > 0
