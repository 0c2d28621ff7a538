"""The device-idle benchmark runs end to end on CPU (no CUDA events there: idle reads 0)."""

import json

from specserve.bench import device_idle


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
