"""The device-idle benchmark runs end to end on CPU (no CUDA events there: idle reads 0)."""

import json

from tools import device_idle


def test_device_idle_writes_both_modes(tmp_path) -> None:
    path = tmp_path / "idle.json"
    rc = device_idle.main(
        ["--model", "dummy:tiny", "--batch", "3", "--input-len", "5", "--max-tokens", "4",
         "--dtype", "float32", "--json", str(path)]
    )  # fmt: skip
    assert rc == 0
    runs = json.loads(path.read_text())["runs"]
    assert [r["overlap"] for r in runs] == [True, False]
    assert all(r["output_tokens"] == 12 for r in runs)


def test_one_mode_alone(tmp_path) -> None:
    path = tmp_path / "idle.json"
    argv = ["--model", "dummy:tiny", "--batch", "2", "--input-len", "4", "--max-tokens", "3"]
    rc = device_idle.main([*argv, "--dtype", "float32", "--modes", "sync", "--json", str(path)])
    assert rc == 0 and json.loads(path.read_text())["runs"][0]["output_tokens"] == 6
