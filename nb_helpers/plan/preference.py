"""Will a DPO step fit? The planner's prediction (nb_helpers.plan.planner) for TRL 1.16's DPOTrainer on a 4-bit base
with LoRA, the way notebook 07 runs it. Symbols as in the planner; B pairs per micro-batch.

What DPO changes against SFT, each traced to the code that allocates it (trl 1.16 trainer/dpo_trainer.py):
  * Chosen and rejected go through the model in one batch. DataCollatorForPreference stacks the B chosen rows over the
    B rejected ones, each prompt + answer, padded to the longest of the 2B: a micro-batch of B pairs is a forward of
    2B sequences, always padded (two answers of one prompt seldom have one length), so SDPA gets a mask.
  * Only the answers carry labels: the fused LM head scores, and keeps the hidden states of, the answer tokens alone
    (`completion_fraction` of each row; the planner's `labelled_fraction`).
  * The reference forward. After the policy's forward, with all its activations kept for the backward, the same
    model runs the 2B sequences again under torch.no_grad() with TRL's frozen "ref" adapter (a copy of the SFT
    adapter, added when a PeftModel with an adapter comes without `ref_model`): no second copy of the base. It saves
    nothing for backward; at its peak it holds one layer's working tensors (the MLP's three i-wide tensors, the
    residual stream and the norm's output, q, k and v, a dequantized weight) and its own tiles of the fused head.
  * The "ref" adapter itself: the SFT adapter's size, in fp32 (peft creates it so; TRL casts only trainable ones).
  * DPOConfig(disable_dropout=True) sets every dropout to 0, LoRA's included: no dropout mask is saved.
The largest of SFT's phases (at 2B sequences) and the reference forward is the peak. Validated against measured DPO
runs by bench/dpo.py (on a GPU).
"""

from __future__ import annotations

from dataclasses import asdict, replace

from nb_helpers.plan.activations import (DTYPE_BYTES, GIB, head_bytes, kept_activation_bytes, residual_bytes,
                                         sliding_layers_masked)
from nb_helpers.plan.architecture import Shape
from nb_helpers.plan.planner import COMPONENT_LABELS, Plan, PlanInput, allocator_bytes, lora_tensors, plan

REFERENCE_PHASE = "the reference forward (no grad)"
DYNAMIC = ("upcast", "activations_kept", "layer_recompute", "logits_loss", "backward_transient", "reference_forward")
REF_ADAPTER_BYTES = 4  # peft creates adapter weights in fp32; TRL's bf16 cast skips the frozen "ref" copy
COMPLETION_FRACTION = 0.45  # the shipped pairs: about 48 of a row's ~110 tokens are the answer (make_pairs)


def pair_input(inp: PlanInput, completion_fraction: float = COMPLETION_FRACTION,
               disable_dropout: bool = True) -> PlanInput:
    """SFT's PlanInput for the forward DPO runs: 2B sequences of prompt + answer, padded, labels on the answers."""
    if not 0 < completion_fraction <= 1:
        raise ValueError(f"completion_fraction={completion_fraction}: the share of a row that is answer, in (0, 1]")
    return replace(inp, batch=2 * inp.batch, padded=True, labelled_fraction=completion_fraction,
                   lora_dropout=0.0 if disable_dropout else inp.lora_dropout)


def reference_forward_bytes(shape: Shape, inp: PlanInput) -> float:
    """The reference forward's working memory at its largest moment (`inp`: the pair input, 2B sequences): one layer's
    tensors under no_grad (the residual stream, the norm's output, q, k, v and the attention output; then the MLP's
    gate or its activation, up and their product), the padding mask's bias, one dequantized weight, and its fused
    head's tiles with the final hidden states of the answer tokens."""
    h, i, T = shape.hidden, shape.intermediate, inp.tokens
    rb, cb = residual_bytes(inp), DTYPE_BYTES[inp.compute_dtype]
    attention = cb * (shape.heads + 2 * shape.kv_heads + shape.heads) * shape.head_dim
    mlp = 3 * cb * i
    masked = not inp.nomask or sliding_layers_masked(shape, inp)
    per_token = 2 * rb * h + max(attention, mlp) + (2 * inp.seq if masked else 0)
    weight = 2 * max(a * b for a, b in shape.linear_dims().values())
    labelled = max(1, round(inp.batch * (inp.seq - 1) * inp.labelled_fraction))
    saved, tiles = head_bytes(shape, inp, labelled)
    return per_token * T + weight + saved + tiles


def plan_preference(shape: Shape, inp: PlanInput, budget_gib: float | None = None,
                    completion_fraction: float = COMPLETION_FRACTION, disable_dropout: bool = True) -> Plan:
    """The predicted peak of a DPO step: `inp` as for SFT (its batch counts pairs), the static bytes plus the frozen
    "ref" adapter, and the largest dynamic phase of SFT's (at 2B sequences) and the reference forward."""
    pairs = pair_input(inp, completion_fraction, disable_dropout)
    sft = plan(shape, pairs)
    c = dict(sft.components)
    c["reference_adapter"] = float(REF_ADAPTER_BYTES * sum(lora_tensors(shape, sft.inputs)))
    labelled = max(1, round(pairs.batch * (pairs.seq - 1) * pairs.labelled_fraction))
    kept, _ = kept_activation_bytes(shape, sft.inputs, True)
    policy_head, _ = head_bytes(shape, sft.inputs, labelled)  # the policy's saved hidden states wait for its backward
    reference = {"activations_kept": kept, "logits_loss": policy_head,
                 "reference_forward": reference_forward_bytes(shape, sft.inputs)}
    phase = sft.peak_phase
    if sum(reference.values()) > sum(c.get(k, 0.0) for k in DYNAMIC if k != "allocator"):
        c.update(dict.fromkeys(DYNAMIC, 0.0), **reference)
        c["allocator"] = allocator_bytes(sft.inputs, sum(reference.values()))
        phase = REFERENCE_PHASE
    components = {k: c.get(k, 0.0) for k in COMPONENT_LABELS}
    notes = [f"DPO: {inp.batch} pair(s) a micro-batch = {pairs.batch} sequences of prompt + answer in one forward, "
             f"then the reference forward; answers are {completion_fraction:.0%} of a row"] + sft.notes
    return Plan(sft.inputs, shape, components, phase, budget_gib, notes=notes)


def plan_preference_for_config(cfg, shape: Shape, context_gib: float | None = None,
                               gpu_capability: tuple[int, int] | None = None,
                               completion_fraction: float = COMPLETION_FRACTION, gpu_extras: bool | None = None) -> Plan:
    """plan_preference for a RunConfig: the planner's reading of cfg (plan_for_config: card, dtype, engine), then
    DPO's forward and reference on top. micro_batch_size counts pairs."""
    from nb_helpers.plan.planner import plan_for_config

    sft = plan_for_config(cfg, shape, context_gib=context_gib, gpu_capability=gpu_capability, gpu_extras=gpu_extras)
    inp = PlanInput(**asdict(sft.inputs))
    return plan_preference(shape, inp, sft.budget_gib, completion_fraction)


__all__ = ["GIB", "REFERENCE_PHASE", "pair_input", "plan_preference", "plan_preference_for_config",
           "reference_forward_bytes"]
