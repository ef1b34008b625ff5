"""Device memory, in one place: what this process uses on the GPU (the emulated card's cap is nb_helpers.plan.budget).

Two numbers answer different questions:
  torch_*_gib      PyTorch's caching allocator (what set_per_process_memory_fraction caps)
  device_used_gib  NVML's device "used" minus the baseline before this process touched CUDA: what nvidia-smi shows,
                   including the CUDA context and bitsandbytes' paged buffers, i.e. what must fit the card.

A 4 GB card gives a process 4 GiB minus its CUDA context (~0.3 GiB on consumer cards, ~0.6 GiB on an H200 with
CUDA 13). PyTorch's per-process fraction caps only its caching allocator, so plan.budget.enforce_budget measures the
context and caps the allocator at budget - context. Memory allocated outside the allocator (bitsandbytes' paged optimizer
buffers) is not capped: the per-step NVML number in metrics.jsonl shows it.
"""

from __future__ import annotations

import os
import subprocess
import sys

from nb_helpers import compat

_NVML_BASELINE: float | None = None  # device "used" bytes without this process; set once by record_nvml_baseline


def _nvml_handle(pynvml, index: int):
    """NVML numbers every GPU of the machine; CUDA only the visible ones (CUDA_VISIBLE_DEVICES=2,3 makes GPU 2
    CUDA device 0). With several processes, each on its own GPU, the wrong one would be measured."""
    visible = [e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
    entry = visible[index] if index < len(visible) else str(index)
    if entry.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
    return pynvml.nvmlDeviceGetHandleByUUID(entry)  # GPU-<uuid> entries


def _nvml_used_bytes(index: int) -> float | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return float(pynvml.nvmlDeviceGetMemoryInfo(_nvml_handle(pynvml, index)).used)
    except Exception:
        return None


def holds_cuda_context(index: int = 0) -> bool:
    """Whether this process already created its CUDA context on `index`. torch.cuda.is_initialized() is not
    enough: importing bitsandbytes initializes CUDA without creating a context (seen with torch 2.11, CUDA 13)."""
    import torch

    held = compat.has_primary_context(index) if torch.cuda.is_available() else None
    return torch.cuda.is_initialized() if held is None else held


def record_nvml_baseline(index: int = 0) -> None:
    """Remember NVML's device "used" without this process, so device_used_gib counts this process only,
    CUDA context included. Best called before the first CUDA call (notebooks 01 and 03 do); when this process
    already holds a context, its size is measured in a fresh subprocess and taken out of the baseline."""
    global _NVML_BASELINE
    if _NVML_BASELINE is not None:
        return
    used = _nvml_used_bytes(index)
    if used is None:
        _NVML_BASELINE = 0.0
        return
    if holds_cuda_context(index):
        used -= measure_context_bytes(index)
    _NVML_BASELINE = used


def process_used_bytes(index: int = 0) -> float | None:
    """What this process holds on the device by NVML's count (context included); None without NVML."""
    used = _nvml_used_bytes(index)
    return None if used is None else used - (_NVML_BASELINE or 0.0)


def outside_allocator_gib(index: int = 0) -> float:
    """This process's device memory that PyTorch's allocator does not hold: the CUDA context, loaded kernels and
    bitsandbytes' paged buffers. enforce_budget takes it out of the budget."""
    import torch

    return max(0.0, (process_used_bytes(index) or 0.0) - torch.cuda.memory_reserved(index)) / 2**30


def format_memory(snap: dict) -> str:
    """A memory_snapshot() as one line per number, '—' where this machine has none (no GPU: only host RSS)."""
    return "\n".join(f"{key:<24} {'—' if value is None else f'{value:.2f} GiB'}" for key, value in snap.items())


def memory_snapshot() -> dict:
    import psutil
    import torch

    snap = {"host_rss_gib": psutil.Process(os.getpid()).memory_info().rss / 2**30}
    if torch.cuda.is_available():
        used = process_used_bytes(torch.cuda.current_device())
        # one read of the allocator's statistics: memory_allocated() and its three siblings each build all of them
        # (a snapshot, taken at every step, took 0.91 ms with the four and 0.22 with one read; H100 hosts, 2026-12-06)
        stats = torch.cuda.memory_stats()
        snap.update(
            torch_allocated_gib=stats.get("allocated_bytes.all.current", 0) / 2**30,
            torch_reserved_gib=stats.get("reserved_bytes.all.current", 0) / 2**30,
            torch_peak_gib=stats.get("reserved_bytes.all.peak", 0) / 2**30,
            torch_peak_allocated_gib=stats.get("allocated_bytes.all.peak", 0) / 2**30,
            device_used_gib=None if used is None else used / 2**30,
        )
    else:
        snap.update(torch_allocated_gib=None, torch_reserved_gib=None, torch_peak_gib=None, torch_peak_allocated_gib=None,
                    device_used_gib=None)
    return snap


_CONTEXT_PROBE = """
import pynvml, torch
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex({index})
before = pynvml.nvmlDeviceGetMemoryInfo(handle).used
torch.ones(1, device="cuda:{index}")
torch.cuda.synchronize()
print(pynvml.nvmlDeviceGetMemoryInfo(handle).used - before - torch.cuda.memory_reserved({index}))
"""


def measure_context_bytes(index: int = 0) -> float:
    """Size of a fresh CUDA context on this GPU and driver, measured in a throwaway process (a few seconds).
    Needed when this process created its context before anyone recorded the memory in use without it."""
    out = subprocess.run([sys.executable, "-c", _CONTEXT_PROBE.format(index=index)], capture_output=True,
                         text=True, timeout=180, check=True)
    return max(0.0, float(out.stdout.strip().splitlines()[-1]))
