"""Which levers of the fast path a run uses: the run's `fast_path` switch, the machine, and `NB_FASTPATH`.

`RunConfig.fast_path` (on by default) is the one switch: off, a GPU run is the plain transformers + peft + TRL stack
of the reference recipe. `NB_FASTPATH` switches single levers for benchmarks without touching the config:
`NB_FASTPATH="kernels=0,nomask=1"`. Without a CUDA GPU every lever is off by default: the CPU path keeps the code its
measured results were made with.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

ENV_VAR = "NB_FASTPATH"
TRUE_WORDS = {"1", "true", "yes", "on", ""}


@dataclass
class FastOptions:
    # GPU: no fp32 upcast of embeddings, head and norms (peft's prepare_model_for_kbit_training), as the plain recipe
    lean: bool = True
    kernels: bool = True  # liger-kernel RMSNorm, SwiGLU, RoPE on CUDA with Triton; stock layers elsewhere
    nomask: bool = True  # right-padded training batches run without an attention mask (flash SDPA, native GQA); GPU
    expandable: bool = True  # PyTorch's expandable allocator segments: less cached-but-free memory (Linux CUDA)
    fused_lora: bool = True  # each 4-bit linear (with its LoRA) as one autograd function (fast.fused_lora); CUDA
    offload: bool = False  # force activation checkpoints into pinned CPU RAM (auto-fit or offload_checkpoints decide)
    reentrant: bool = True  # reentrant checkpoints: the forward runs under no_grad, with no saved-tensor hooks; GPU
    direct_dequant: bool = True  # bitsandbytes' dequantize kernels called directly (no per-call wrapper); CUDA
    graphs: bool = True  # checkpointed layers replayed as CUDA graphs (fast.graphed_layers); CUDA, reentrant
    direct_optim: bool = True  # bitsandbytes' AdamW kernels called directly (fast.optimizer_step); CUDA
    pad_lengths: bool = True  # eager batches padded to a multiple of 64 tokens, as graphs' are: cuDNN's attention
    #                           builds plans for each new length (0.15 s a new length at 8 x 2048 on an H200); CUDA

    @classmethod
    def from_env(cls, fast_path: bool = True, **overrides) -> "FastOptions":
        """The machine's defaults, then NB_FASTPATH, then keyword overrides. `fast_path=False` on a GPU is the plain
        stack: every lever off, and no upcast (the recipe never calls prepare_model_for_kbit_training)."""
        import torch

        gpu = torch.cuda.is_available()
        on = gpu and fast_path
        values = {f.name: on for f in fields(cls) if f.name not in ("lean", "offload")}
        values.update(lean=gpu, offload=False)
        if fast_path:  # NB_FASTPATH applies on a CPU too: the tests exercise the levers' CPU halves through it
            values.update(env_levers())
        values.update(overrides)
        return cls(**values)

    @classmethod
    def for_run(cls, cfg) -> "FastOptions":
        return cls.from_env(fast_path=cfg.fast_path)

    def speed_levers(self) -> dict[str, bool]:
        """The levers proper: everything but `lean`, which is the recipe's own prepare rather than a speed-up."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "lean"}


def env_levers() -> dict[str, bool]:
    """NB_FASTPATH as {lever: on}; an unknown lever is an error that lists the known ones."""
    known = [f.name for f in fields(FastOptions)]
    values = {}
    for item in filter(None, (s.strip() for s in os.environ.get(ENV_VAR, "").split(","))):
        key, _, value = item.partition("=")
        if key.strip() not in known:
            raise ValueError(f"{ENV_VAR}: unknown lever {key.strip()!r}; known: {', '.join(known)}")
        values[key.strip()] = value.strip().lower() in TRUE_WORDS
    return values


def options_of(model) -> FastOptions:
    """The levers this model was prepared with (attach_lora records them), else the environment's."""
    return getattr(model, "_nb_fast", None) or FastOptions.from_env()


def gpu_options(fast_path: bool = True) -> FastOptions:
    """The levers a GPU run uses: the planner plans for a GPU even on a machine without one."""
    defaults = {f.name: fast_path for f in fields(FastOptions)}
    defaults.update(lean=True, offload=False)
    if fast_path:
        defaults.update(env_levers())
    return FastOptions(**defaults)


def kernels_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None and importlib.util.find_spec("triton") is not None
