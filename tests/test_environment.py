import re

import pytest

from nb_helpers import environment
from nb_helpers.environment import bnb_roundtrip, check_environment, compute_dtype_for


@pytest.mark.parametrize("capability, dtype", [
    ((7, 5), "float16"),   # GTX 1650 / T4 (Turing): no native bf16 even if is_bf16_supported() says yes
    ((6, 1), "float16"),   # Pascal
    ((8, 0), "bfloat16"), ((8, 6), "bfloat16"), ((8, 9), "bfloat16"), ((9, 0), "bfloat16"),
    (None, "bfloat16"),    # CPU
])
def test_compute_dtype_by_capability(capability, dtype):
    assert compute_dtype_for(capability) == dtype


def test_turing_gets_fp16_even_when_torch_claims_bf16(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (7, 5))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert environment.resolve_compute_dtype("auto") == "float16"
    assert environment.resolve_compute_dtype("bfloat16") == "bfloat16"  # an explicit choice wins


def test_bitsandbytes_really_quantizes_on_cpu():
    ok, detail = bnb_roundtrip("cpu")
    assert ok, detail
    assert "smaller" in detail


def test_report_lines_and_no_failures_here():
    report = check_environment(check_hub=False)
    text = report.text()
    for line in text.splitlines()[: len(report.checks)]:
        assert re.match(r"^\[(OK|WARN|FAIL) *\] [^:]+: .+", line), line
    assert not report.failed, text
    names = {c.name for c in report.checks}
    assert {"Python", "torch", "GPU", "compute dtype", "bitsandbytes 4-bit", "disk"} <= names
    assert report.recommended["compute_dtype"] in {"bfloat16", "float16"}


def test_hub_check_honours_offline_flag(monkeypatch):
    environment.hub_reachable.cache_clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert environment.hub_reachable() is False
    environment.hub_reachable.cache_clear()


@pytest.mark.gpu
def test_gpu_report_has_capability_and_vram():
    report = check_environment(check_hub=False)
    assert report.facts["cuda"] and report.facts["vram_total_gib"] > 1
    assert report.facts["compute_dtype"] == compute_dtype_for(report.facts["capability"])
