import json

import pytest

from nb_helpers.analysis import flag_problems, reference_table, to_markdown
from nb_helpers.metrics import median, read_metrics


def step(i, loss=1.0, step_s=1.0, vram=2.0):
    return {"step": i, "epoch": i / 10, "loss": loss, "step_s": step_s, "device_used_gib": vram, "tokens": 100}


def test_truncated_last_line_is_skipped_but_corruption_elsewhere_is_not(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(step(1)) + "\n" + json.dumps(step(2)) + "\n" + '{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    path.write_text(json.dumps(step(1)) + "\n" + '{"step": 2, "lo' + "\n" + json.dumps(step(3)) + "\n")
    with pytest.raises(ValueError, match=":2: corrupt metrics line"):
        read_metrics(path)
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_median():
    assert median([3, None, 1, 2]) == 2 and median([1, 2, 3, 4]) == 2.5 and median([None]) is None


def test_reference_table_columns_and_cpu_blanks():
    rows = reference_table([step(1, vram=None), {"step": 1, "epoch": 0.1, "eval_loss": 0.5}])
    assert list(rows[0]) == ["Epoch", "Step", "Train Loss", "VRAM Usage (GB)", "Time/Step (s)"]
    assert len(rows) == 1 and rows[0]["VRAM Usage (GB)"] is None
    md = to_markdown(rows)
    assert md.splitlines()[0].startswith("| Epoch | Step") and "—" in md


def test_flags_vram_spikes_and_rising_loss():
    calm = [step(i, loss=2.0 - i * 0.1) for i in range(1, 13)]
    assert flag_problems(calm) == []
    hot = calm[:5] + [step(6, vram=3.95)] + calm[6:]
    assert any("VRAM above 3.9 GiB on 1 step" in f and "step 6" in f for f in flag_problems(hot))
    spiky = calm[:7] + [step(8, step_s=5.0)] + calm[8:]
    assert any("over 2x the median" in f and "steps 8" in f for f in flag_problems(spiky))
    rising = [step(i, loss=1.0 + i * 0.1) for i in range(1, 10)]
    assert any("lower learning_rate" in f for f in flag_problems(rising))
