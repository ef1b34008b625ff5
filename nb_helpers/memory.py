"""Making a big GPU behave like a small card: a memory budget that includes the CUDA context.

A 4 GB card gives a process 4 GiB minus its CUDA context (~0.3 GiB on consumer cards, ~0.6 GiB on an
H200 with CUDA 13). PyTorch's per-process fraction caps only its caching allocator, so we measure the
context and cap the allocator at budget - context. Memory allocated outside the allocator (bitsandbytes'
paged optimizer buffers) is not capped: the per-step NVML number in metrics.jsonl shows it.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

from . import metrics


@dataclass
class Budget:
    budget_gib: float
    context_gib: float
    allocator_cap_gib: float
    total_gib: float

    def describe(self) -> str:
        return (f"budget {self.budget_gib:.2f} GiB = CUDA context {self.context_gib:.2f} GiB + "
                f"PyTorch allocator cap {self.allocator_cap_gib:.2f} GiB (card has {self.total_gib:.1f} GiB)")


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


def enforce_budget(budget_gib: float, device: int = 0) -> Budget:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("enforce_budget needs a CUDA GPU; on the CPU there is no device memory to cap")
    metrics.record_nvml_baseline(device)  # corrected for a context created earlier, if there is one
    torch.ones(1, device=f"cuda:{device}")  # make sure the context exists so it can be measured
    torch.cuda.synchronize(device)
    used = metrics._nvml_used_bytes(device)
    baseline = metrics._NVML_BASELINE or 0.0
    context = max(0.0, (used or 0.0) - baseline - torch.cuda.memory_reserved(device)) / 2**30
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    cap = budget_gib - context
    if cap <= 0.1:
        raise RuntimeError(f"a {budget_gib} GiB budget leaves nothing after the {context:.2f} GiB CUDA context; "
                           "raise budget_gib")
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    return Budget(budget_gib, context, cap, total)

