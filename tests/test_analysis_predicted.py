"""Predicted against measured: the planner's numbers in summary.json next to what the run measured."""

import pytest

from nb_helpers.ui.analysis import predicted_vs_measured, predicted_vs_measured_report

COMPONENTS = {"context": 0.30, "runtime": 0.145, "weights_4bit": 0.5, "optimizer_paged": 0.05, "upcast": 0.0,
              "activations_kept": 0.6, "allocator": 0.1}  # GiB, as train() writes them
TOTAL = sum(COMPONENTS.values())  # 1.695


def summary(**extra):
    base = {"device": "cpu (x86_64, 2 threads)", "status": "completed", "peak_vram_gib": None,
            "peak_reserved_gib": None, "predicted_peak_gib": TOTAL, "predicted_phase": "the loss backward",
            "predicted_components_gib": dict(COMPONENTS)}
    return {**base, **extra}


def by_label(rows):
    return {r[""]: r for r in rows}


def test_gpu_run_has_measured_totals_and_relative_errors():
    rows = predicted_vs_measured(summary(device="NVIDIA H200", peak_vram_gib=1.5, peak_reserved_gib=1.0))
    labels = [r[""] for r in rows]
    assert labels[:2] == ["CUDA context", "runtime overhead (kernels)"]
    assert "fp32 upcast while loading" not in labels  # zero components are left out
    device, reserved = rows[-2], rows[-1]
    assert "device peak" in device[""] and "the loss backward" in device[""]
    assert device["predicted (GiB)"] == pytest.approx(TOTAL) and device["measured (GiB)"] == 1.5
    assert device["error"] == f"{100 * (TOTAL / 1.5 - 1):+.1f}%" == "+13.0%"
    # reserved = total less what lives outside PyTorch's allocator (context, runtime, paged optimizer)
    assert reserved["predicted (GiB)"] == pytest.approx(TOTAL - 0.30 - 0.145 - 0.05)
    assert reserved["error"] == "+20.0%"
    assert all(r["measured (GiB)"] is None and r["error"] is None for r in rows[:-2])
    report = predicted_vs_measured_report(summary(device="NVIDIA H200", peak_vram_gib=1.5, peak_reserved_gib=1.0))
    assert "measured 1.50 GiB (+13.0%" in report and "| 4-bit linear weights | 0.500 | — | — |" in report


def test_cpu_run_says_measured_is_unavailable_and_still_shows_the_prediction():
    report = predicted_vs_measured_report(summary())
    assert "Measured device memory is not available (CPU run)" in report
    assert f"| {TOTAL:.3f} | — | — |" in report and "| CUDA context | 0.300 | — | — |" in report
    assert by_label(predicted_vs_measured(summary()))["CUDA context"]["error"] is None


def test_gpu_run_without_nvml_and_an_oom_run_are_said_so():
    report = predicted_vs_measured_report(summary(device="NVIDIA GeForce GTX 1650", status="oom",
                                                  peak_reserved_gib=1.25))
    assert "NVML could not read this GPU" in report and "CPU run" not in report
    assert "status `oom`" in report and "| 1.200 | 1.250 | -4.0% |" in report  # reserved is still compared


@pytest.mark.parametrize("missing", ["predicted_peak_gib", "predicted_components_gib", "both"])
def test_runs_from_before_the_planner_get_one_line_not_an_exception(missing):
    old = summary(peak_vram_gib=2.0)
    for key in (["predicted_peak_gib", "predicted_components_gib"] if missing == "both" else [missing]):
        old.pop(key)
    assert predicted_vs_measured(old) == []
    report = predicted_vs_measured_report(old)
    assert report.startswith("_No prediction") and "\n" not in report
    assert predicted_vs_measured_report({}).startswith("_No summary.json yet")  # a run still training: not "older"
