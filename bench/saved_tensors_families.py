"""Count what one decoder layer saves for backward, per token, for each model family, with saved-tensor hooks (CPU).

Like bench/saved_tensors.py, for the families nb_helpers.plan.architecture models: 1- and 2-layer models of each family
(hidden 256, 8 heads, 2 KV heads; tests/families.py), one real SFTTrainer step on the lean path (4-bit base, LoRA
r=8 on the recipe's q,k,v,o under the model's names, dropout 0.05, bf16, TRL's fused loss, GC off, stock layers,
no mask) at 128 and 256 tokens; the per-layer, per-token difference against the planner's CUDA formula. On the CPU
each LoRA dropout mask is bf16 instead of bool (1 byte more per input feature of each target). A sliding layer's
mask bias grows with the sequence, so the two-length difference counts it at (128 + 256) * 2 bytes, not 256 * 2.

    python bench/saved_tensors_families.py      # ~3 minutes on 2 cores

Measured 2026-11-30 on the 2-core AMD EPYC (AVX-512 BF16), torch 2.13 CPU, transformers 5.17, peft 0.21, trl 1.16,
bitsandbytes 0.50.2: every family equal to the formula plus those CPU differences, to the byte.
"""

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from families import build, tiny_config  # noqa: E402

from nb_helpers.plan.architecture import Shape  # noqa: E402
from nb_helpers.fast import FastOptions  # noqa: E402
from nb_helpers.models import ensure_embedded_model, load_tokenizer  # noqa: E402
from nb_helpers.plan.activations import layer_activation_bytes_per_token  # noqa: E402
from nb_helpers.plan.architecture import plan_targets  # noqa: E402
from nb_helpers.plan.planner import PlanInput  # noqa: E402
sys.path.insert(0, str(ROOT / "bench"))
from saved_tensors import step_saved_bytes  # noqa: E402

WIDTHS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
              max_position_embeddings=4096)
CASES = {  # name: (family, config changes, sliding)
    "llama": ("llama", {}, False),
    "qwen3": ("qwen3", {"head_dim": 64}, False),
    "phi3": ("phi3", {}, False),
    "gemma3 (full layers)": ("gemma3_text", {"head_dim": 64, "sliding_window": 4096}, False),
    "gemma3 (sliding, window 64)": ("gemma3_text", {"head_dim": 64, "sliding_window": 64}, True),
}


def config_for(case: str, layers: int, vocab: int) -> dict:
    family, changes, sliding = CASES[case]
    extra = {"layer_types": ["sliding_attention" if sliding else "full_attention"] * layers} \
        if family == "gemma3_text" else {}
    return tiny_config(family, vocab=vocab, **WIDTHS, num_hidden_layers=layers, **changes, **extra)


def saved_bytes(config: dict, tokenizer, tokens: int) -> int:
    folder = tempfile.mkdtemp()
    torch.manual_seed(0)
    build(config, "cpu").to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return step_saved_bytes(folder, tokenizer, tokens, fast=FastOptions(lean=True, kernels=False, nomask=True,
                                                                       expandable=False))


def main() -> None:
    tokenizer = load_tokenizer(str(ensure_embedded_model(verbose=False)))
    failures = []
    for case, (_, _, sliding) in CASES.items():
        counts = {(n, t): saved_bytes(config_for(case, n, len(tokenizer)), tokenizer, t) for n in (1, 2)
                  for t in (128, 256)}
        measured = ((counts[2, 256] - counts[1, 256]) - (counts[2, 128] - counts[1, 128])) / 128
        shape = Shape.from_config(config_for(case, 2, len(tokenizer)))
        inp = PlanInput(seq=256, fused_kernels=False, nomask=True)
        cuda = layer_activation_bytes_per_token(shape, inp, padded=False, sliding=sliding)
        masks = sum(shape.linear_dims()[t][0] for t in plan_targets(shape, inp.targets))  # bf16, not bool
        bias = 2 * 128 if sliding else 0  # the two-length difference of a per-layer (s x s) bias
        print(f"{case:<28} measured {measured:>9,.0f}  planner {cuda:>9,.0f} + CPU {masks + bias:>6,}"
              f" = {cuda + masks + bias:>9,.0f}", flush=True)
        if measured != cuda + masks + bias:
            failures.append(case)
    assert not failures, f"the planner's per-layer count no longer matches the stack for {failures}"


if __name__ == "__main__":
    main()
