"""Confidence calibration: the ECE by hand, and temperature scaling that repairs a confidence
set made over-confident on purpose."""

from __future__ import annotations

import pytest
import torch

from specserve.train.calibrate import calibrate, expected_calibration_error, fit_temperature


def test_ece_by_hand() -> None:
    conf = torch.tensor([0.05, 0.05, 0.95, 0.95])
    label = torch.tensor([0.0, 0.2, 1.0, 0.5])
    # two bins: |0.05 - 0.1| and |0.95 - 0.75|, each holding half the rows
    assert expected_calibration_error(conf, label, bins=2) == pytest.approx(0.5 * 0.05 + 0.5 * 0.2)
    assert expected_calibration_error(torch.zeros(0), torch.zeros(0)) == 0.0


def test_temperature_scaling_repairs_an_overconfident_head() -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4000, generator=g) * 3
    true_t = 2.5
    label = torch.sigmoid(z / true_t)  # the real acceptance: softer than sigmoid(z) claims
    assert fit_temperature(z, label) == pytest.approx(true_t, rel=0.02)
    fit, held = slice(0, 2000), slice(2000, 4000)
    cal = calibrate([z[fit]], [label[fit]], [z[held]], [label[held]])
    assert cal.ece_before[0] > 0.05
    assert cal.ece_after[0] < 0.01
    assert cal.ece_after_all < cal.ece_before_all


def test_no_rows_keeps_temperature_one() -> None:
    assert fit_temperature(torch.zeros(0), torch.zeros(0)) == 1.0
