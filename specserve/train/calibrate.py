"""Per-position temperature scaling of the head's confidences, and their calibration error.

The verify budget multiplies confidences into survival estimates (a[j] = prod c[m], m <= j),
so a confidence that is systematically high at deep positions compounds into long drafts that
fail. One temperature per draft position, c = sigmoid(z / T_i), fit on held-out rows by
minimising the binary cross-entropy against the soft acceptance labels, fixes the scale without
changing the order of the confidences (so it cannot hurt their ranking).

Calibration error (ECE): confidences in equal-width bins, sum over bins of
(rows in bin / rows) * |mean confidence - mean label|, with labels the soft acceptance labels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ECE_BINS = 15
_LOG_T_RANGE = (-4.0, 4.0)  # temperatures e^-4 .. e^4


def expected_calibration_error(
    conf: torch.Tensor,  # [N] in [0, 1]
    label: torch.Tensor,  # [N] in [0, 1]
    bins: int = ECE_BINS,
) -> float:
    if conf.numel() == 0:
        return 0.0
    conf, label = conf.double().flatten(), label.double().flatten()
    idx = (conf * bins).long().clamp_(0, bins - 1)
    sum_c = torch.bincount(idx, conf, minlength=bins)
    sum_y = torch.bincount(idx, label, minlength=bins)
    return float((sum_c - sum_y).abs().sum() / conf.numel())


def _bce_at(logits: torch.Tensor, label: torch.Tensor, log_t: float) -> float:
    z = logits / math.exp(log_t)
    return float(F.binary_cross_entropy_with_logits(z, label))


def fit_temperature(logits: torch.Tensor, label: torch.Tensor) -> float:
    """T minimising BCE(sigmoid(logits / T), label): a coarse grid over log T, then golden-
    section search around the best point (the loss is smooth and unimodal in log T in practice;
    the grid guards against a poor start)."""
    if logits.numel() == 0:
        return 1.0
    logits, label = logits.double().flatten(), label.double().flatten()
    lo, hi = _LOG_T_RANGE
    grid = [lo + (hi - lo) * i / 32 for i in range(33)]
    best = min(grid, key=lambda t: _bce_at(logits, label, t))
    step = (hi - lo) / 32
    a, b = max(lo, best - step), min(hi, best + step)
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = _bce_at(logits, label, c), _bce_at(logits, label, d)
    for _ in range(40):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = _bce_at(logits, label, c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = _bce_at(logits, label, d)
    return math.exp((a + b) / 2)


@dataclass
class Calibration:
    temperatures: list[float]  # one per draft position
    ece_before: list[float]  # per position, on the evaluation rows
    ece_after: list[float]
    ece_before_all: float  # all positions pooled
    ece_after_all: float

    def as_dict(self) -> dict:
        return {
            "temperatures": self.temperatures,
            "ece_before": self.ece_before,
            "ece_after": self.ece_after,
            "ece_before_all": self.ece_before_all,
            "ece_after_all": self.ece_after_all,
        }


def calibrate(
    fit_logits: list[torch.Tensor],  # per position: [N_i] confidence logits (fit rows)
    fit_labels: list[torch.Tensor],  # per position: [N_i] soft acceptance labels
    eval_logits: list[torch.Tensor],  # per position, on rows not used to fit
    eval_labels: list[torch.Tensor],
) -> Calibration:
    temps = [fit_temperature(z, y) for z, y in zip(fit_logits, fit_labels)]
    before = [torch.sigmoid(z.double()) for z in eval_logits]
    after = [torch.sigmoid(z.double() / t) for z, t in zip(eval_logits, temps)]
    ys = [y.double() for y in eval_labels]
    pooled_y = torch.cat(ys) if ys else torch.zeros(0)
    return Calibration(
        temps,
        [expected_calibration_error(c, y) for c, y in zip(before, ys)],
        [expected_calibration_error(c, y) for c, y in zip(after, ys)],
        expected_calibration_error(torch.cat(before), pooled_y) if before else 0.0,
        expected_calibration_error(torch.cat(after), pooled_y) if after else 0.0,
    )
