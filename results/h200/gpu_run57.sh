#!/bin/bash
# Session 12, final code: the R = 0.5 sweep again (the probe backoff acts only where plain
# decoding wins: R = 0.5, C >= 64; at R = 0.8 gpu_run55 ran no probe below C = 256).
SWEEP_RS=0.5 SWEEP_TAG=c bash results/h200/gpu_run55.sh
