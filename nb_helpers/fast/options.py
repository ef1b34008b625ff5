"""Which levers of the fast path a run uses: the run's `fast_path` switch, the machine, and `NB_FASTPATH`.

`RunConfig.fast_path` (off by default; notebook 06 turns it on) is the one switch: off, a GPU run is the plain
transformers + peft + TRL stack of the reference recipe. `NB_FASTPATH` switches single levers for benchmarks without
touching the config: `NB_FASTPATH="kernels=0,nomask=1"`. Without a CUDA GPU every lever is off by default: the CPU path keeps the code its
measured results were made with.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

ENV_VAR = "NB_FASTPATH"
DECODED_ABSMAX = "_nb_decoded_absmax"  # a QuantState's absmax decoded once to fp32 (fast.fused_lora, lever absmax_once)
NF4_KERNEL = "_nb_nf4_kernel"  # on a QuantState: the Triton kernel that dequantizes it (fast.fused_lora, lever nf4_kernel)
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
    dead_tail: bool = True  # a checkpointed layer's recompute skips the product nothing reads (the MLP's down
    #                         projection in Llama-style layers; fast.recompute); CUDA, reentrant, fused_lora
    fused_block: bool = True  # Llama layers: the MLP as one function, the residual add fused into the norm, adds
    #                           skipped where their value is thrown away (fast.fused_block); CUDA, fused_lora
    dropout_kernels: bool = True  # LoRA's dropout drawn inside its rank-r products: no dropped copy or mask written
    #                               or kept (fast.lora_dropout, Triton); CUDA, fused_lora, 16-bit inputs
    absmax_once: bool = True  # double quantization's absmax decoded once per weight and kept in fp32, not at every
    #                           dequantize (fast.fused_lora.keep_decoded_absmax); CUDA, fused_lora, direct_dequant
    nf4_kernel: bool = True  # NF4 weights dequantized by our Triton kernel rather than bitsandbytes' CUDA kernel: the
    #                          same bits in two thirds of its GPU time (fast.nf4_kernel); CUDA, fused_lora, direct_dequant
    fewer_recomputes: bool = True  # auto-fit leaves the last layers unrecomputed where the budget holds their
    #                                activations (RunConfig.no_recompute_layers; fast.checkpoints); CUDA, checkpointing
    down_once: bool = True  # a checkpointed layer's recompute reuses its forward's LoRA products dropout(x) A^T
    #                         (tokens x r each) instead of reading x and drawing the mask again (fast.recompute);
    #                         CUDA, dead_tail, dropout_kernels
    array_rows: bool = True  # the training rows' token columns read as numpy arrays: TRL's collator copies each row
    #                          once instead of converting Python lists element by element (fast.host_step); CUDA
    one_token_count: bool = True  # tokens counted once, by TRL's loss after the forward: the Trainer's own count
    #                               waits on every backward before the optimizer step is queued (fast.host_step); CUDA
    mode_on_change: bool = True  # model.train() walks the modules only when the mode changes: the Trainer calls it
    #                              before every micro-batch (fast.host_step); CUDA
    trainable_grads: bool = True  # the Trainer zeroes and clips the trainable parameters' gradients, not walking every
    #                               module twice a step for them (fast.host_step); CUDA
    rows_ahead: bool = True  # the next step's batches read and collated once the optimizer step is queued, while
    #                          the GPU still works: not after the step's synchronize (fast.host_step); CUDA
    frozen_norms: bool = True  # RMSNorm's backward for frozen norm weights over all rows at once, the layer input's
    #                            two gradients summed inside it (fast.frozen_norms); CUDA, fused_block, liger
    saved_attention: bool = True  # where checkpoints go to CPU RAM, each layer's forward sends its attention output
    #                               there too and the recompute reuses it: no attention in the recompute
    #                               (fast.saved_attention); CUDA, fused_block, offload, down_once, not graphs

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

    def skips_dead_tail(self) -> bool:
        """Whether checkpointed recomputes skip their dead product (fast.recompute): the lever, reentrant checkpoints,
        and the fused 4-bit layers that do the skipping."""
        return bool(self.dead_tail and self.reentrant and self.fused_lora)

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


# What each lever changes, and what it gave alone where it was measured: one H200 (an H100 where the text says so)
# under an emulated 4 GiB budget, TinyLlama-1.1B shape with random weights, effective batch 8, 2026-11-30 to 2026-12-06
# (bench/results/runs/ has each run, with our default beside it in the same run).
LEVERS = {
    "lean": ("the base frozen and left 16-bit (no fp32 embeddings, head and norms); also with fast_path=False",
             "1.03 GiB less at 8 x 512 than peft's prepare_model_for_kbit_training, same speed"),
    "kernels": ("liger-kernel's fused RMSNorm, SwiGLU and RoPE (Triton)", "0.15 GiB less at 8 x 512, same speed"),
    "nomask": ("no attention mask for right-padded batches: SDPA's fused kernel, native grouped-query attention",
               "0.04 GiB less at 8 x 512, more at long rows"),
    "expandable": ("PyTorch's allocator grows segments in place", "0.19 GiB less cached-but-free memory at 8 x 512"),
    "fused_lora": ("each 4-bit layer and its LoRA branch as one autograd function",
                   "16,434 against 12,265 tokens/s at 8 x 512"),
    "reentrant": ("checkpointed layers run their forward under no_grad", "22,555 against 14,950 tokens/s at 8 x 512"),
    "direct_dequant": ("bitsandbytes' dequantize kernels called without their Python wrapper",
                       "22,555 against 14,454 tokens/s at 8 x 512"),
    "graphs": ("checkpointed layers replayed as CUDA graphs (auto-fit takes them where they fit)",
               "41,146 against 20,132 tokens/s at 8 x 512, for 3.40 against 2.49 GiB"),
    "offload": ("activation checkpoints in pinned CPU RAM, copied on a side stream (auto-fit takes it where it buys "
                "a bigger micro-batch)", "8 x 1 fits at 8 x 2048: 32,582 against 26,789 tokens/s at 4 x 2"),
    "direct_optim": ("bitsandbytes' AdamW kernels called directly, no device sync per adapter tensor",
                     "44,448 against 38,693 tokens/s at 8 x 2048 in one run, within noise in a second"),
    "pad_lengths": ("batches padded to a multiple of 64 tokens, so cuDNN plans its attention once per length",
                    "56,327 against 47,469 tokens/s at 8 x 2048"),
    "dead_tail": ("the recompute under gradient checkpointing skips the one product its backward never reads",
                  "58,451 against 54,351 tokens/s at 8 x 2048 (GPU busy 15.4 against 15.9 us/token)"),
    "fused_block": ("Llama layers: the MLP as one function, the residual add inside the norm's kernel, no kernel for "
                    "what the recompute throws away",
                    "GPU busy 15.0 against 15.5 us/token at 8 x 2048 (59,468 against 59,182 tokens/s), 14.9 against 15.2 "
                    "at 8 x 512"),
    "dropout_kernels": ("LoRA's dropout drawn inside its rank-r products (Triton): no dropped copy or mask written",
                        "GPU busy 15.5 against 16.0 us/token at 8 x 2048 (13.1 against 13.8 without copies) and 0.33 GiB "
                        "less (2.86 against 3.19 GiB); 14.80 against 14.95 at 8 x 512"),
    "absmax_once": ("double quantization's absmax decoded once and kept in fp32 (the base is frozen)",
                    "GPU busy 14.3 against 14.6 us/token at 8 x 2048 (62,591 against 59,990 tokens/s), 14.1 against "
                    "14.5 at 8 x 512, for 0.06 GiB"),
    "nf4_kernel": ("NF4 weights dequantized by a Triton kernel over whole quantization blocks: bitsandbytes' math and "
                   "bits, wider loads and stores", "GPU busy 17.2 against 18.0 us/token on the shipped data (an H100, "
                   "2026-12-07); a TinyLlama layer's seven weights in 38.6 against 58.2 us in bf16"),
    "fewer_recomputes": ("auto-fit leaves the last layers unrecomputed (no_recompute_layers) where the budget holds "
                         "their activations: no recompute in their backward",
                         "GPU busy 13.6 against 13.8 us/token at 8 x 2048 (2 layers; 63,249 against 63,039 tokens/s), "
                         "13.7 against 14.1 at 8 x 512 (3 layers, graphed; 49,415 against 44,072), for 3.70-3.78 of "
                         "4 GiB (2026-12-03)"),
    "down_once": ("the recompute reuses its forward's LoRA products dropout(x) A^T: the input is not read and the "
                  "mask not drawn a third time", "GPU compute 12.41 against 12.55 us/token at 8 x 2048 and 12.97 against "
                  "13.12 at 8 x 512, steps the same, for 0.02 GiB (2026-12-03)"),
    "array_rows": ("the training rows' token columns read as numpy arrays: TRL's collator copies each row once",
                   "70,040 against 67,218 tokens/s at 8 x 2048; at 8 x 512 within the host's drift; collating 8 x 2048 "
                   "tokens 4.2 against 0.3 ms of host time on a 2-core EPYC"),
    "one_token_count": ("tokens counted by TRL's loss alone: no `.item()` after each backward keeps the optimizer step "
                        "waiting", "70,040 against 60,758 tokens/s at 8 x 2048, 56,815 against 46,724 at 8 x 512"),
    "mode_on_change": ("`model.train()`, which the Trainer calls before every micro-batch, walks the modules only "
                       "when the mode changes", "70,040 against 68,552 tokens/s at 8 x 2048, 56,815 against 52,186 "
                       "at 8 x 512"),
    "trainable_grads": ("the Trainer zeroes and clips the trainable parameters' gradients without walking every "
                        "module for them, twice a step", "on an H100: 0.0357 against 0.0405 s a step on the shipped "
                        "data (25,068 against 21,779 tokens/s), within the host's drift at 8 x 512 and 8 x 2048 "
                        "(2026-12-06)"),
    "rows_ahead": ("the next step's batches are read and collated while the GPU finishes this step, not after the "
                   "step's synchronize", "on an H100: 0.0250 against 0.0238 and 0.0244 s a step on the shipped data "
                   "(35,260 against 37,052 and 36,158 tokens/s), within the host's drift at 8 x 2048 (2026-12-06)"),
    "frozen_norms": ("the norms' backward for frozen weights: liger's own kernel over the rows, no weight gradient, "
                     "the layer input's two gradients summed inside it", "GPU compute 12.39 against 12.65 us/token at "
                     "8 x 2048 (69,926 against 66,934 tokens/s; norm backward kernels 2.9 against 7.2 ms a step), "
                     "12.76 against 13.05 at 8 x 512 (steps the same; 2026-12-03)"),
    "saved_attention": ("where checkpoints go to CPU RAM, each layer's attention output goes with them and the "
                        "recompute reuses it instead of attending again", "GPU compute 11.99 against 12.31 us/token "
                        "at 8 x 2048 (cuDNN's forward 8.0 against 15.7 ms a step), 74,297 against 73,332 tokens/s; "
                        "auto-fit then keeps no layer unrecomputed (two without) but the dequantized weights, 3.12 "
                        "against 3.82 GiB (2026-12-03)"),
}
