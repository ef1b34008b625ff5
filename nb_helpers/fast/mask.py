"""No attention mask for right-padded training batches. TRL's collator pads on the right, and a causal model's real
tokens never attend to later positions, so the mask changes nothing for them (pad positions carry no label).
Without a mask, SDPA runs a fused flash-style kernel (cuDNN's on an H200) with native grouped-query attention
instead of the memory-efficient kernel over keys and values repeated to every head plus a (batch, 1, seq, seq) bias.
"""

from __future__ import annotations

from nb_helpers.frontend import say_once


def decoder_of(model):
    """The LlamaModel-like decoder inside a (peft-wrapped) causal LM."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, getattr(base, "base_model_prefix", "model"), base)


def install_mask_drop(model) -> None:
    """In training mode, the decoder ignores a 2-D attention mask that only marks right padding. build_trainer
    checks every training batch on the CPU (no device sync) and turns this off for good if one is not
    right-padded. Evaluation and generation (left-padded prompts) never enter it: model.training is False."""
    decoder = decoder_of(model)
    if getattr(decoder, "_nb_mask_drop", None) is not None:
        return
    decoder._nb_mask_drop = True

    def drop(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if module.training and module._nb_mask_drop and mask is not None and mask.dim() == 2 \
                and kwargs.get("past_key_values") is None:
            kwargs["attention_mask"] = None
            return args, kwargs
        return None

    decoder.register_forward_pre_hook(drop, with_kwargs=True)


def is_right_padded(mask) -> bool:
    """Each row is ones then zeros (CPU tensor)."""
    import torch

    lengths = mask.sum(-1, keepdim=True)
    return bool(torch.equal(mask.bool(), torch.arange(mask.shape[-1]) < lengths))


def guard_collator(collator, model):
    """Wrap the training collator: a batch that is not right-padded switches the mask drop off (said once)."""
    decoder = decoder_of(model)

    def collate(examples):
        batch = collator(examples)
        mask = batch.get("attention_mask") if hasattr(batch, "get") else None
        if getattr(decoder, "_nb_mask_drop", False) and mask is not None and mask.dim() == 2 \
                and mask.device.type == "cpu" and not is_right_padded(mask):
            decoder._nb_mask_drop = False
            say_once("mask", "[fast] a training batch is not right-padded: attention masks are kept from now on")
        return batch

    return collate
