import re

import pytest

from nb_helpers import environment
from nb_helpers.environment import bnb_roundtrip, check_environment
from nb_helpers.plan import dtypes
from nb_helpers.plan.dtypes import compute_dtype_for


@pytest.mark.parametrize("capability, dtype", [
    ((7, 5), "float16"),   # GTX 1650 / T4 (Turing): no native bf16 even if is_bf16_supported() says yes
    ((6, 1), "float16"),   # Pascal
    ((8, 0), "bfloat16"), ((8, 6), "bfloat16"), ((8, 9), "bfloat16"), ((9, 0), "bfloat16"),
])
def test_compute_dtype_by_capability(capability, dtype):
    assert compute_dtype_for(capability) == dtype


@pytest.mark.parametrize("units, onednn, aten, dtype", [
    (True, True, "AVX512", "bfloat16"),   # AVX-512 BF16 or AMX: native bf16
    (False, False, "AVX2", "float32"),    # most laptops and desktops
    (True, False, "AVX512", "float32"),   # ONEDNN_MAX_CPU_ISA=AVX2 on a bf16 CPU
    (True, True, "AVX2", "float32"),      # ATEN_CPU_CAPABILITY=avx2 on a bf16 CPU
    (False, True, "AVX512", "float32"),   # AVX-512 without BF16 (Skylake-X): oneDNN would emulate
])
def test_cpu_dtype_is_bf16_only_where_it_is_native(monkeypatch, units, onednn, aten, dtype):
    import torch

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: units, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: aten)
    assert compute_dtype_for(None) == dtype
    assert ("no native bf16" in environment.dtype_reason(None, dtype)) == (dtype == "float32")


def test_isa_limits_make_this_cpu_choose_fp32():
    """The real switches, in a fresh interpreter (torch reads them at start): an AVX2-limited process picks fp32
    whatever this CPU has, and the environment check says why."""
    import subprocess
    import sys

    code = ("from nb_helpers.environment import check_environment; from nb_helpers.plan.dtypes import cpu_report;"
            "r = check_environment(check_hub=False);"
            "print(cpu_report()['capability'], r.facts['compute_dtype']);"
            "print([c.detail for c in r.checks if c.name == 'compute dtype'][0])")
    env = {**__import__("os").environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
           "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    first, detail = out.strip().splitlines()[-2:]
    assert first == "AVX2 float32", out
    assert detail.startswith("float32 (this CPU has no native bf16")


def test_turing_gets_fp16_even_when_torch_claims_bf16(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (7, 5))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert dtypes.resolve_compute_dtype("auto") == "float16"
    assert dtypes.resolve_compute_dtype("bfloat16") == "bfloat16"  # an explicit choice wins


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
    assert report.recommended["compute_dtype"] == report.facts["compute_dtype"]
    assert report.recommended["compute_dtype"] in {"bfloat16", "float16", "float32"}


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
