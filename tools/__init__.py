"""Developer diagnostics, outside the wheel: run as `python tools/NAME.py ...` from the repo root."""
