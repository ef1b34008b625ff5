"""The tiny model with the real fused 4-bit layers, checkpointed the fast path's way, and one training step: shared by
tests/test_recompute.py and tests/test_fused_block.py."""

import torch

from nb_helpers.fast import state, checkpoints, fused_lora
from nb_helpers.fast.options import FastOptions


def fused_model(tiny_cfg, dtype="float32", kernels=False, targets=None, fused_block=True):
    """LoRA with dropout 0.1 and a random B, the fused 4-bit layers installed (on a CPU too), inputs requiring grad.
    `fused_block`: whether attach_lora may install the fused layer blocks (it does so on CUDA only)."""
    from nb_helpers.lora import attach_lora
    from nb_helpers.models import ModelChoice, load_4bit

    cfg = tiny_cfg.replace(compute_dtype=dtype, lora_dropout=0.1, target_modules=targets or tiny_cfg.target_modules)
    torch.manual_seed(0)
    fast = FastOptions(lean=True, kernels=kernels, nomask=False, fused_block=fused_block)
    model = attach_lora(load_4bit(cfg, ModelChoice(cfg.model, "tiny", "test")), cfg, fast=fast)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # B starts at zero; a random B makes every LoRA gradient count
            torch.nn.init.normal_(param, std=0.5)
    if not torch.cuda.is_available():
        assert fused_lora.install(model) > 0  # the fast path installs them on CUDA only; the CPU test does it here
    model.enable_input_require_grads()
    model.train()
    return model


def use_checkpoints(model, dead_tail: bool, offload: bool = False, graphs: bool = False, no_recompute: int = 0,
                    down_once: bool = True):
    """Reentrant checkpoints through the fast path's checkpoint functions, the recompute's dead product skipped or not,
    its forward's LoRA products reused or not, the last `no_recompute` layers not checkpointed."""
    state.attach(model, FastOptions(lean=True, fused_lora=True, reentrant=True, dead_tail=dead_tail, graphs=graphs,
                                    down_once=down_once), use_graphs=graphs, no_recompute=no_recompute)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    checkpoints.set_checkpoint_offload(model, offload)


def train_step(model, ids, autocast=None):
    """(loss, the trainable parameters' gradients) of one step, with the same dropout masks in every call."""
    ids = ids.to(model.device)  # on a machine with a GPU the model loads there
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]
