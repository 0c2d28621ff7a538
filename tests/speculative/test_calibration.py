"""The start-up calibration of the step-cost curve: context, per-request and row terms apart."""

import math
import random

import pytest


def test_calibration_measures_the_context_cost_and_rows_apart():
    """Start-up calibration against a device whose step costs 1 ms + 2 ms per row + 5 us per
    context token + 0.3 ms per request: kv_cost, req_cost and f come out right, whatever
    contexts and request counts the synthetic steps use."""
    from types import SimpleNamespace

    from specserve.speculative import calibration as bp

    calls = []

    def synthetic(self, rows, context=bp.CALIBRATION_CONTEXT, n_req=None):
        n_req = n_req or min(rows, 8)
        calls.append((rows, context, n_req))
        return 1e-3 + 2e-3 * rows + 5e-6 * n_req * context + 3e-4 * n_req

    eng = SimpleNamespace(
        config=SimpleNamespace(max_num_seqs=8),
        max_num_batched_tokens=64,
        max_model_len=2048,
        slot_pool=SimpleNamespace(k=3),
    )
    policy = bp.StartupCalibration(eng)
    policy._synthetic_step = synthetic.__get__(policy)
    policy.engine.runner = SimpleNamespace(graphs=None)
    curve = policy.load_or_calibrate([1, 8, 16, 40], None)
    assert curve.kv_cost == pytest.approx(5e-6)
    assert curve.req_cost == pytest.approx(3e-4)
    for rows in (1, 8, 16, 40):
        assert curve(rows) == pytest.approx(1e-3 + 2e-3 * rows)
    assert {bp.CALIBRATION_CONTEXT, bp.KV_CALIBRATION_CONTEXT} <= {c for _, c, _ in calls}
    assert (8, bp.CALIBRATION_CONTEXT, 2) in calls  # verify-shaped: 4 rows per request


def test_fixed_terms_measured_too_high_never_make_the_curve_negative():
    """A start-up kv_cost above what large synthetic steps cost (seen on the CPU: 27 us/token,
    so 256 requests x 128 tokens 'cost' more than the whole 0.83 s step) leaves f a share of
    every step, and real steps folded in through the curve's own ratios stay finite and
    positive (they compounded to -1e307 and NaN before)."""
    from types import SimpleNamespace

    from specserve.speculative import calibration as bp

    def synthetic(self, rows, context=bp.CALIBRATION_CONTEXT, n_req=None):
        n_req = n_req or min(rows, 256)
        if context > bp.CALIBRATION_CONTEXT:  # context cost grows faster at long contexts
            return 0.05 + 3e-3 * rows + 3e-5 * n_req * context
        return 0.05 + 3e-3 * rows + 1e-5 * n_req * context

    eng = SimpleNamespace(
        config=SimpleNamespace(max_num_seqs=256),
        max_num_batched_tokens=1280,
        max_model_len=2048,
        slot_pool=SimpleNamespace(k=4),
        runner=SimpleNamespace(graphs=None),
    )
    policy = bp.StartupCalibration(eng)
    policy._synthetic_step = synthetic.__get__(policy)
    buckets = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    curve = policy.load_or_calibrate(buckets, None)
    assert curve.kv_cost * 256 * bp.CALIBRATION_CONTEXT > synthetic(policy, 256)
    assert all(t > 0 for _, t in curve.points())
    rng = random.Random(0)
    for _ in range(300):
        rows = rng.randint(1, 600)
        n = min(rows, 256)
        curve.record(rows, synthetic(policy, rows, n_req=n), kv_tokens=n * 200, requests=n)
    assert all(math.isfinite(t) and t > 0 for _, t in curve.points())
    assert all(math.isfinite(curve(r)) and curve(r) > 0 for r in range(1, 700))


def test_each_curve_is_measured_in_the_shape_of_the_steps_it_prices(tmp_path):
    """The synchronous curve prices verify steps (1 + k rows per request), the plain curve
    decode steps (one row each): their synthetic steps have those shapes, whatever the rows
    (decode-shaped up to max_num_seqs, the synchronous curve jumped where the shape changed),
    each is cached apart, and the plain curve reuses the fixed terms it is given."""
    from types import SimpleNamespace

    from specserve.speculative import calibration as bp

    calls = []

    def synthetic(self, rows, context=bp.CALIBRATION_CONTEXT, n_req=None):
        calls.append((rows, context, n_req))
        return 1e-3 + 2e-3 * rows + 3e-4 * (n_req or rows)

    eng = SimpleNamespace(
        config=SimpleNamespace(
            max_num_seqs=16, block_size=16, enforce_eager=True, tensor_parallel_size=1
        ),
        max_num_batched_tokens=80,
        max_model_len=2048,
        slot_pool=SimpleNamespace(k=4),
        runner=SimpleNamespace(graphs=None),
        model_name="m",
        device=SimpleNamespace(type="cpu"),
        dtype="float32",
    )
    cal = bp.StartupCalibration(eng)
    cal._synthetic_step = synthetic.__get__(cal)
    buckets = [1, 8, 16, 40, 80]
    cal.load_or_calibrate(buckets, tmp_path)
    f_calls = {(r, n) for r, c, n in calls if c == bp.CALIBRATION_CONTEXT and r in buckets}
    assert {(1, 1), (8, 2), (16, 4), (40, 8), (80, 16)} <= f_calls
    calls.clear()
    plain = cal.load_or_calibrate(buckets[:3], tmp_path, decode_shaped=True, fixed=(0.0, 3e-4))
    assert {(r, n) for r, _, n in calls} == {(1, 1), (8, 8), (16, 16)}  # no fixed-term runs
    assert plain.req_cost == 3e-4 and plain(8) == pytest.approx(1e-3 + 2e-3 * 8)
    assert len(list((tmp_path / "step-cost").iterdir())) == 2
    calls.clear()
    cal.load_or_calibrate(buckets, tmp_path)  # cached: nothing runs
    assert calls == []
