"""Count what one decoder layer saves for backward, per token, with saved-tensor hooks (runs on the CPU).

Builds 1- and 2-layer Llamas with TinyLlama's widths, runs one real SFTTrainer training step (4-bit base, LoRA r=8
on q,k,v,o, dropout 0.05, bf16 autocast, TRL's fused loss, GC off) at two lengths, and takes the per-layer,
per-token difference. On the CPU, SDPA runs in fp32 (CPU autocast leaves it alone) and dropout keeps a bf16 mask;
on CUDA, SDPA runs in bf16 and the mask is bool. The planner's CUDA formula plus those two differences must equal
the CPU count exactly.

    python bench/saved_tensors.py      # ~1 minute
"""

import sys
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nb_helpers.config import RunConfig  # noqa: E402
from nb_helpers.models import ModelChoice, ensure_embedded_model, load_4bit, load_tokenizer  # noqa: E402
from nb_helpers.plan.activations import layer_activation_bytes_per_token  # noqa: E402
from nb_helpers.plan.planner import PlanInput, Shape  # noqa: E402
from nb_helpers.training import TrainingRun, build_trainer  # noqa: E402
from nb_helpers.lora import attach_lora  # noqa: E402

DIMS = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
            max_position_embeddings=4096, tie_word_embeddings=False)


def saved_bytes(layers: int, tokens: int) -> int:
    folder = tempfile.mkdtemp()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **DIMS)).to(torch.bfloat16).save_pretrained(folder)
    tokenizer = load_tokenizer(str(ensure_embedded_model(verbose=False)))
    tokenizer.save_pretrained(folder)
    return step_saved_bytes(folder, tokenizer, tokens)


def step_saved_bytes(folder: str, tokenizer, tokens: int, fast=None) -> int:
    """Bytes of every distinct storage one real SFTTrainer training step saves for backward (GC off)."""
    cfg = RunConfig(model=folder, gradient_checkpointing=False, micro_batch_size=1, grad_accum=1, max_length=tokens,
                    max_steps=1, compute_dtype="bfloat16", runs_dir=tempfile.mkdtemp(), task_eval_samples=0,
                    eval_file=None)
    model = attach_lora(load_4bit(cfg, ModelChoice(folder, "probe", "")), cfg, fast=fast)
    rows = [{"input_ids": torch.randint(100, 30000, (tokens,)).tolist()}]
    trainer = build_trainer(TrainingRun(cfg, tokenizer=tokenizer, train_rows=rows, model=model, run_dir=Path(cfg.runs_dir)))
    batch = next(iter(trainer.get_train_dataloader()))
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return t

    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.training_step(trainer.model, batch)
    return sum(storages.values())


def main() -> None:
    counts = {(layers, tokens): saved_bytes(layers, tokens) for layers in (1, 2) for tokens in (128, 256)}
    per_layer_token = ((counts[2, 256] - counts[1, 256]) - (counts[2, 128] - counts[1, 128])) / 128
    shape = Shape.from_config({**DIMS, "num_hidden_layers": 2})
    cuda = layer_activation_bytes_per_token(shape, PlanInput(), padded=False)
    h, nh, nkv, hd = 2048, 32, 4, 64
    cpu_extra = (2 * nh * hd * 2 + 2 * nkv * hd * 2) + 4 * h  # fp32 instead of bf16 SDPA tensors; bf16 dropout masks
    print(f"measured on the CPU: {per_layer_token:,.0f} bytes per token per layer")
    print(f"planner (CUDA) {cuda:,.0f} + CPU differences {cpu_extra:,.0f} = {cuda + cpu_extra:,.0f}")
    assert per_layer_token == cuda + cpu_extra, "the planner's per-layer count no longer matches the stack"


if __name__ == "__main__":
    main()
