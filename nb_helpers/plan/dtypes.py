"""Which compute dtype this machine should train in: the one source of truth for that choice.

GPUs: bf16 from compute capability 8.0 (Ampere), fp16 below (Turing: GTX 1650, RTX 20xx, T4).
CPUs: bf16 only where the CPU has bf16 units (AVX-512 BF16 or AMX); fp32 on everything else, which is most
laptops and desktops (AVX2 only), because emulated bf16 is several times slower than fp32 there.
"""

from __future__ import annotations

from nb_helpers import compat


def cpu_bf16_native() -> bool:
    """True only where bf16 matmuls run in hardware: AVX-512 BF16 or AMX, with torch's oneDNN and ATen kernels
    allowed to use them. Elsewhere (AVX2-only laptops and desktops, AVX-512 without BF16) bf16 is emulated and
    one training step took about 13x longer than in fp32 (bench/RESULTS.md). Each probe honours one of
    the ISA limits that reproduce such a CPU: ONEDNN_MAX_CPU_ISA (oneDNN) and ATEN_CPU_CAPABILITY (ATen)."""
    import torch

    units = compat.cpu_bf16_units()
    aten_avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return bool((units["avx512_bf16"] or units["amx"]) and units["onednn_bf16"] and aten_avx512)


def cpu_report() -> dict:
    """What torch sees of this CPU, and the compute dtype that follows (environment check and bench/cpu_bench.py)."""
    import torch

    units = compat.cpu_bf16_units()
    return {"capability": torch.backends.cpu.get_cpu_capability(), "onednn_bf16": units["onednn_bf16"],
            "avx512_bf16": units["avx512_bf16"], "amx": units["amx"], "auto_dtype": compute_dtype_for(None)}


def compute_dtype_for(capability: tuple[int, int] | None) -> str:
    """bf16 needs Ampere (compute capability 8.0) or newer. Turing (7.5, GTX 1650 / RTX 20xx) gets fp16:
    torch.cuda.is_bf16_supported() can answer True there through slow emulation, so we decide by capability.
    None means CPU: bf16 autocast where the CPU has bf16 units, fp32 everywhere else."""
    if capability is None:
        return "bfloat16" if cpu_bf16_native() else "float32"
    return "bfloat16" if tuple(capability) >= (8, 0) else "float16"


def gpu_compute_dtype(requested: str, capability: tuple[int, int] | None) -> str:
    """What a GPU of this compute capability trains in when the config asks for `requested`: "auto" picks by
    capability; an explicit bf16 on a card without it (below 8.0) becomes fp16 (preflight says so when it happens).
    The planner, preflight and `plan` all ask here."""
    dtype = compute_dtype_for(capability) if requested == "auto" else requested
    if dtype == "bfloat16" and capability is not None and tuple(capability) < (8, 0):
        return "float16"
    return dtype


def dtype_reason(capability: tuple[int, int] | None, dtype: str) -> str:
    """Why compute_dtype_for chose `dtype`, in words for the environment check and the config printout."""
    if capability is None:
        if dtype == "bfloat16":
            return ("this CPU has bf16 units (AVX-512 BF16 / AMX), where a bf16 training step measured 1.3x "
                    "faster than fp32")
        return ("this CPU has no native bf16 (no AVX-512 BF16 / AMX, or limited by ONEDNN_MAX_CPU_ISA / "
                "ATEN_CPU_CAPABILITY): fp32, because emulated bf16 made a training step about 13x slower")
    if dtype == "bfloat16":
        return "compute capability >= 8.0"
    return "compute capability < 8.0 has no native bf16 (is_bf16_supported() may still say True through emulation)"


def cuda_capability() -> tuple[int, int] | None:
    import torch

    return tuple(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None


def resolve_compute_dtype(requested: str) -> str:
    return compute_dtype_for(cuda_capability()) if requested == "auto" else requested
