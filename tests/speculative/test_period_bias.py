"""The mean real / predicted period of a kind of step (period_bias.py)."""

import pytest

from specserve.speculative.period_bias import HIGH, MIN_SAMPLES, WINDOW, PeriodBias


def test_factor_is_one_until_enough_ratios_then_their_mean():
    bias = PeriodBias()
    for _ in range(MIN_SAMPLES - 1):
        bias.record(1.1, 1.0)
    assert bias.factor == 1.0
    bias.record(1.3, 1.0)
    assert bias.factor == pytest.approx((1.1 * (MIN_SAMPLES - 1) + 1.3) / MIN_SAMPLES)


def test_one_wild_step_is_clamped_and_old_ratios_leave_the_window():
    bias = PeriodBias()
    for _ in range(WINDOW - 1):
        bias.record(1.0, 1.0)
    bias.record(2.5, 0.001)  # a compile: 2,500x its prediction counts as HIGH
    assert bias.factor == pytest.approx((WINDOW - 1 + HIGH) / WINDOW)
    for _ in range(WINDOW):
        bias.record(0.9, 1.0)  # the window slides: only these remain
    assert bias.factor == pytest.approx(0.9)
    bias.record(0.0, 1.0)  # no measurement: ignored
    bias.record(1.0, 0.0)
    assert bias.factor == pytest.approx(0.9)
