import pytest
import torch

from nb_helpers.config import RunConfig
from nb_helpers.models import (EMBEDDED_NAME, ModelChoice, keep_cpu_weights_trainable, load_4bit, load_tokenizer,
                               memory_breakdown, resolve_model, sixteen_bit_bytes_from_config)


@pytest.mark.parametrize("tied", [True, False])
def test_sixteen_bit_size_from_config_matches_real_parameter_count(tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    real = sum(p.numel() for p in model.parameters())  # tied weights are one Parameter
    estimate = sixteen_bit_bytes_from_config(config)
    assert estimate["total_params"] == real
    assert estimate["bytes_16bit"] == 2 * real


def test_4bit_breakdown_counts_half_a_byte_per_linear_weight(tiny_model_dir):
    cfg = RunConfig(model=str(tiny_model_dir), compute_dtype="bfloat16")  # 16-bit embeddings, whatever the CPU
    model = load_4bit(cfg, ModelChoice(str(tiny_model_dir), "tiny", "test"))
    parts = memory_breakdown(model)
    linear_params = sixteen_bit_bytes_from_config(model.config)["linear_params"]
    assert parts["linear_4bit"] == linear_params // 2  # two 4-bit codes per byte
    # Double quant, per linear layer of n weights: one uint8 absmax per 64-weight block, one fp32 absmax per
    # 256 of those, the 256-entry fp32 code of the second level, the 16-entry NF4 code and one fp32 offset.
    import bitsandbytes as bnb

    expected = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            n = module.in_features * module.out_features
            blocks = n // 64
            expected += blocks + 4 * -(-blocks // 256) + 4 * 256 + 4 * 16 + 4
    assert parts["quant_constants"] == expected
    assert parts["embeddings_and_head"] == 2 * 2 * model.config.vocab_size * 64  # bf16, untied embed + head
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")


def test_explicit_model_wins(tiny_model_dir, capsys):
    choice = resolve_model(RunConfig(model=str(tiny_model_dir)))
    assert choice.path == str(tiny_model_dir) and choice.reason == "set explicitly in the config"
    assert "set explicitly" in capsys.readouterr().out


def test_fallback_to_embedded_says_why(monkeypatch, capsys, embedded_dir):
    from nb_helpers import models

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(models, "hub_reachable", lambda: False)
    monkeypatch.setattr(models, "tinyllama_cached", lambda: False)
    choice = resolve_model(RunConfig())
    assert choice.name == EMBEDDED_NAME and "Hub unreachable" in choice.reason
    assert "Hub unreachable" in capsys.readouterr().out


def test_cpu_eval_pass_does_not_break_training_gradients(tiny_model_dir, no_gpu):
    """Regression: bitsandbytes repacks 4-bit weights for CPU inference on the first eval-mode forward and
    then trains through a kernel without autograd, silently dropping gradients through the base layers."""
    from nb_helpers.lora import attach_lora

    cfg = RunConfig(model=str(tiny_model_dir), lora_dropout=0.0, gradient_checkpointing=False)
    choice = ModelChoice(str(tiny_model_dir), "tiny", "test")
    ids = torch.randint(0, 1000, (2, 16))

    def first_layer_grad(eval_first: bool):
        torch.manual_seed(0)
        model = attach_lora(load_4bit(cfg, choice), cfg)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # non-zero B so gradients reach lora_A through every layer
                torch.nn.init.normal_(p, std=0.02)
        if eval_first:
            model.eval()
            with torch.no_grad():
                model(input_ids=ids)
            model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        return next(p.grad for n, p in model.named_parameters() if "layers.0." in n and "lora_A" in n)

    assert torch.allclose(first_layer_grad(False), first_layer_grad(True), rtol=1e-3, atol=1e-6)


def test_keep_cpu_weights_trainable_switches_off_repacking(tiny_model_dir):
    import bitsandbytes as bnb

    model = load_4bit(RunConfig(model=str(tiny_model_dir)), ModelChoice(str(tiny_model_dir), "tiny", "test"))
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and not any(getattr(m, "support_avx512bf16_for_cpu", False) for m in layers)


def test_generation_on_a_cpu_dequantizes_once_and_gives_the_same_answers(tiny_model_dir, no_gpu):
    """Inside dequantized_on_cpu each 4-bit layer (under a LoRA layer too) multiplies by its weight dequantized once:
    the same logits and greedy answers as the 4-bit layers, which are all back afterwards, also after an error."""
    import bitsandbytes as bnb

    from nb_helpers.lora import attach_lora
    from nb_helpers.models import dequantized_on_cpu

    cfg = RunConfig(model=str(tiny_model_dir), lora_dropout=0.0)
    torch.manual_seed(0)
    model = attach_lora(load_4bit(cfg, ModelChoice(str(tiny_model_dir), "tiny", "test")), cfg).eval()
    for name, p in model.named_parameters():
        if "lora_B" in name:  # a nonzero B: the adapters act on top of the swapped base layers
            torch.nn.init.normal_(p, std=0.02)
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    ids = torch.randint(0, 1000, (3, 12))

    def logits_and_answer():
        with torch.no_grad():
            return model(input_ids=ids).logits, model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)

    four_bit = logits_and_answer()
    with dequantized_on_cpu(model) as swapped:
        assert swapped == len(layers) > 0 and not any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
        dequantized = logits_and_answer()
    assert torch.allclose(four_bit[0], dequantized[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(four_bit[1], dequantized[1])
    with pytest.raises(KeyboardInterrupt), dequantized_on_cpu(model):
        raise KeyboardInterrupt
    assert [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)] == layers  # the same objects, back
    with dequantized_on_cpu(model, ram_fraction=0.0) as swapped:  # the copies would not fit: nothing changes
        assert swapped == 0 and [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)] == layers


@pytest.mark.slow
def test_embedded_model_is_a_real_chat_model(embedded_dir):
    """The embedded SmolLM2 must know things and stop at the end of its turn (EOS fixed after GGUF conversion)."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(str(embedded_dir))
    assert tokenizer.eos_token == "<|im_end|>"
    from nb_helpers.plan.dtypes import compute_dtype_for

    # The CPU's own dtype: bf16 generation on an AVX2-only CPU is emulated and takes minutes instead of seconds.
    model = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=getattr(torch, compute_dtype_for(None)))
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=30, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:]
    assert "Paris" in tokenizer.decode(new, skip_special_tokens=True)
    assert new[-1].item() == tokenizer.eos_token_id  # stopped by itself, well before 30 tokens


def test_a_cache_entry_is_whole_or_absent_and_two_writers_keep_the_first(tmp_path):
    from nb_helpers.models import cache_entry

    target = tmp_path / "cache" / "entry"
    with pytest.raises(RuntimeError), cache_entry(target) as partial:
        (partial / "half").write_text("written before the stop")
        raise RuntimeError("interrupted")
    assert not target.exists() and list(target.parent.iterdir()) == []  # nothing that looks complete, nothing left

    with cache_entry(target) as first, cache_entry(target) as second:  # two processes filling it at once
        (first / "file").write_text("first")
        (second / "file").write_text("second")
    assert (target / "file").read_text() == "second"  # the inner one finished first: the entry is its copy, whole
    assert [p.name for p in target.parent.iterdir()] == ["entry"]
