"""Sampling a step's rows: the flat row layout, verification (greedy and exact rejection
sampling, one-cumsum prefix acceptance) and its fused Triton pass. Plain decoding is the case
with no verify rows."""
