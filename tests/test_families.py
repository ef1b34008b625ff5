"""Model families beyond Llama: parameter counts against transformers, the planner, LoRA target names from the model,
and a training step through the package on the CPU."""

import json
import sys

import pytest

from nb_helpers.plan.architecture import FAMILIES, Shape, UnsupportedModel, load_shape, resolve_targets
from nb_helpers.config import PROJECT_ROOT, ConfigError
from nb_helpers.plan.planner import QKVO, PlanInput, plan

sys.path.insert(0, str(PROJECT_ROOT / "tests"))
from families import TINY, build, tiny_config  # noqa: E402

SHAPES = sorted((PROJECT_ROOT / "nb_helpers" / "plan" / "shapes").glob("*.json"))


def real_counts(model) -> dict:
    import torch

    linear = sum(m.weight.numel() for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and "lm_head" not in n)
    biases = sum(m.bias.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None)
    return {"total": sum(p.numel() for p in model.parameters()), "linear": linear, "biases": biases}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("family", sorted(TINY))
def test_tiny_parameter_counts_equal_the_built_model(family, tied):
    config = tiny_config(family, tie_word_embeddings=tied)
    shape = Shape.from_config(config)
    real = real_counts(build(config))
    assert shape.family == family and shape.tied == tied
    assert (shape.total_params, shape.linear_params, shape.bias_params) == \
        (real["total"], real["linear"], real["biases"])


@pytest.mark.parametrize("path", SHAPES, ids=[p.stem for p in SHAPES])
def test_real_sized_parameter_counts_equal_the_built_model(path):
    """The public models' config.json values (nb_helpers/plan/shapes/), built on the meta device: no memory, no hub."""
    shape = load_shape(str(path))
    assert shape.total_params == real_counts(build(json.loads(path.read_text())))["total"]


def test_family_features_are_read_from_config_json():
    qwen3 = Shape.from_config(tiny_config("qwen3"))
    assert qwen3.qk_norm and qwen3.head_dim == 32 != 64 // 4 and qwen3.tied
    assert Shape.from_config(tiny_config("qwen2")).bias_layers == ("q_proj", "k_proj", "v_proj")
    gemma = Shape.from_config(tiny_config("gemma3_text"))
    assert (gemma.norms_per_layer, gemma.sliding_layers, gemma.sliding_window) == (4, 1, 16)
    assert gemma.tied and gemma.scaled_embeddings  # Gemma 3 ties its head by default: config.json may not say
    phi = Shape.from_config(tiny_config("phi3"))
    assert phi.all_linear() == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") and phi.rotary_dim == 8
    real = load_shape(str(PROJECT_ROOT / "nb_helpers" / "plan" / "shapes" / "gemma3-1b.json"))
    assert (real.sliding_layers, real.layers, real.vocab) == (22, 26, 262144)


def test_recipe_targets_map_to_each_familys_names():
    phi = Shape.from_config(tiny_config("phi3"))
    assert resolve_targets(QKVO, phi.all_linear()) == ("qkv_proj", "o_proj")
    assert resolve_targets(["q_proj", "v_proj", "up_proj"], phi.all_linear()) == ("qkv_proj", "gate_up_proj")
    assert resolve_targets(["qkv_proj"], phi.all_linear()) == ("qkv_proj",)
    assert resolve_targets(QKVO, Shape.from_config(tiny_config("qwen3")).all_linear()) == QKVO
    with pytest.raises(ValueError, match=r"\['wq'\] do not exist in this model.*qkv_proj"):
        resolve_targets(["wq"], phi.all_linear())


@pytest.mark.parametrize("family", sorted(TINY))
def test_planner_runs_and_targets_are_the_models_linear_layers(family):
    from nb_helpers.lora import check_targets, linear_layer_names

    config = tiny_config(family)
    shape, model = Shape.from_config(config), build(config)
    names = set(linear_layer_names(model)) - {"lm_head"}
    assert set(shape.all_linear()) == names
    recipe = plan(shape, PlanInput(seq=64, targets=QKVO))
    assert set(recipe.inputs.targets) <= names and recipe.inputs.targets == shape.attention_targets()
    assert check_targets(model, list(QKVO)) == list(shape.attention_targets())
    every = plan(shape, PlanInput(seq=64, targets=("all-linear",)))
    assert set(every.inputs.targets) == names
    assert every.components["lora_weights"] > recipe.components["lora_weights"] > 0
    rank = 8
    expected = sum(rank * (a + b) for a, b in (shape.linear_dims()[t] for t in recipe.inputs.targets))
    assert recipe.components["lora_weights"] == 2 * shape.layers * expected  # bf16 adapters


def test_sliding_window_layers_pay_for_a_mask_only_past_the_window():
    gemma = load_shape(str(PROJECT_ROOT / "nb_helpers" / "plan" / "shapes" / "gemma3-1b.json"))
    base = dict(batch=1, gradient_checkpointing=False, context_gib=0.6, gpu_capability=(9, 0))
    from nb_helpers.plan.activations import layer_activation_bytes_per_token, sliding_layers_masked

    assert sliding_layers_masked(gemma, PlanInput(seq=512, **base)) == 0
    assert sliding_layers_masked(gemma, PlanInput(seq=2048, **base)) == 22
    inp = PlanInput(seq=2048, **base)
    full = layer_activation_bytes_per_token(gemma, inp, padded=False)
    sliding = layer_activation_bytes_per_token(gemma, inp, padded=False, sliding=True)
    # k and v repeated to all 4 heads of 256 (bf16, 2 bytes), plus the mask turned into a bf16 bias row per token
    assert sliding - full == (8 - 4) * 4 * 256 - 4 * 1 * 256 + 2 * 2048


def test_qk_norms_and_fused_qkv_are_counted():
    from nb_helpers.plan.activations import layer_activation_bytes_per_token

    inp = PlanInput(seq=64, fused_kernels=False)
    llama = Shape.from_config(tiny_config("llama", head_dim=16))
    qwen3 = Shape.from_config(tiny_config("qwen3", head_dim=16))
    assert layer_activation_bytes_per_token(qwen3, inp, False) - layer_activation_bytes_per_token(llama, inp, False) \
        == 4 * (4 + 2) * 16 + 4 * (4 + 2)  # fp32 copy of every q and k head + one rstd per head
    phi = Shape.from_config(tiny_config("phi3"))
    plain = Shape.from_config(tiny_config("llama"))
    lora_phi = sum(3 * phi.linear_dims()[t][0] + 16 for t in ("qkv_proj", "o_proj"))
    lora_llama = sum(3 * plain.linear_dims()[t][0] + 16 for t in QKVO)
    extra = layer_activation_bytes_per_token(phi, inp, False) - layer_activation_bytes_per_token(plain, inp, False)
    assert extra == 2 * (4 + 2) * 16 + lora_phi - lora_llama  # the fused qkv output stays alive behind v


def test_fused_kernels_only_where_the_gpu_path_has_them():
    inp = PlanInput(seq=256)
    qwen3 = Shape.from_config(tiny_config("qwen3"))
    llama = Shape.from_config(tiny_config("llama"))
    from nb_helpers.plan.activations import layer_activation_bytes_per_token as per_token

    assert per_token(llama, inp, False) < per_token(llama, PlanInput(seq=256, fused_kernels=False), False)
    assert per_token(qwen3, inp, False) == per_token(qwen3, PlanInput(seq=256, fused_kernels=False), False)


def test_an_unmodelled_family_says_what_is_missing(tmp_path, cli):
    with pytest.raises(UnsupportedModel, match="'gpt2' is not modelled.*qwen3.*Training may still work"):
        Shape.from_config({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100})
    with pytest.raises(UnsupportedModel, match="image-text"):
        Shape.from_config({"model_type": "gemma3", "text_config": {"hidden_size": 64}})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    result = cli("plan", "--model", tmp_path)
    assert result.returncode == 2 and "'gpt2' is not modelled" in result.stderr
    assert "Traceback" not in result.stderr


def test_softcapping_is_named_when_not_modelled():
    gemma2 = Shape.from_config({**tiny_config("llama"), "model_type": "gemma2", "head_dim": 16,
                                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})
    result = plan(gemma2, PlanInput(seq=64))
    assert any("attention soft-capping (50.0) is not modelled" in n for n in result.notes)
    capped = result.components["logits_loss"]
    uncapped = plan(Shape(**{**gemma2.__dict__, "final_softcap": None}), PlanInput(seq=64)).components["logits_loss"]
    assert capped > uncapped  # the tanh of the final soft-cap holds one more logits tile


def test_plan_cli_plans_each_family_from_config_json(cli):
    result = cli("plan", "--model", PROJECT_ROOT / "nb_helpers" / "plan" / "shapes" / "phi-4-mini.json", "--seq", "512",
                 "--context-gib", "0.3")
    assert "fused qkv_proj and gate_up_proj" in result.stdout and "r=8 on qkv_proj,o_proj" in result.stdout
    result = cli("plan", "--model", PROJECT_ROOT / "nb_helpers" / "plan" / "shapes" / "qwen3-1.7b.json", "--json",
                 "--targets", "q_proj,v_proj")
    data = json.loads(result.stdout)
    assert data["shape"]["qk_norm"] and data["inputs"]["targets"] == ["q_proj", "v_proj"]


def test_plan_cli_goes_through_the_run_config(cli, tmp_path):
    """`plan --config run.json` predicts what `train --config run.json` would run; flags override, --set too."""
    from nb_helpers.config import RunConfig
    from nb_helpers.plan.planner import plan_for_config

    model = PROJECT_ROOT / "nb_helpers" / "plan" / "shapes" / "qwen3-0.6b.json"
    cfg = RunConfig(model=str(model), max_length=1024, micro_batch_size=2, grad_accum=4, lora_r=16,
                    target_modules=["all-linear"], budget_gib=6.0)
    cfg.save(tmp_path / "run.json")
    result = cli("plan", "--config", tmp_path / "run.json", "--context-gib", "0.3", "--gpu-capability", "8.6", "--json")
    data = json.loads(result.stdout)
    expected = plan_for_config(cfg, load_shape(str(model)), context_gib=0.3, gpu_capability=(8, 6))
    assert data["peak_gib"] == pytest.approx(expected.peak_gib) and data["budget_gib"] == 6.0
    assert (data["inputs"]["seq"], data["inputs"]["batch"], data["inputs"]["rank"]) == (1024, 2, 16)
    result = cli("plan", "--config", tmp_path / "run.json", "--seq", "256", "--set", "lora_r=4", "--json")
    data = json.loads(result.stdout)
    assert (data["inputs"]["seq"], data["inputs"]["rank"]) == (256, 4)
    assert cli("plan", "--config", tmp_path / "run.json", "--set", "lora_r=0").returncode == 2


# --- the LoRA path and training on the CPU, through the package ---------------------------------------------------
@pytest.fixture(scope="module")
def family_dir(tmp_path_factory, tokenizer_dir):
    """A tiny random model of a family saved with the embedded model's tokenizer (and its chat template)."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    made = {}

    def make(family):
        if family not in made:
            config = tiny_config(family, vocab=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
            torch.manual_seed(0)
            model = build(config, device="cpu").to(torch.bfloat16)
            made[family] = tmp_path_factory.mktemp(family)
            model.save_pretrained(made[family])
            tokenizer.save_pretrained(made[family])
        return made[family]

    return make


@pytest.mark.parametrize("family", ["phi3", "gemma3_text"])  # the two most unlike a Llama
def test_one_training_step_per_family_on_the_cpu(family, family_dir, tmp_path, capsys):
    """train() from config to saved adapter: preflight maps the recipe's q,k,v,o to the model's own names."""
    from nb_helpers.config import RunConfig
    from nb_helpers.training import train

    cfg = RunConfig(model=str(family_dir(family)), micro_batch_size=2, grad_accum=1, max_steps=1, max_length=96,
                    max_train_samples=2, eval_file=None, task_eval_samples=0, runs_dir=str(tmp_path / "runs"))
    run_dir = train(cfg, verbose=family == "phi3")
    summary = json.loads((run_dir / "summary.json").read_text())
    saved = json.loads((run_dir / "config.json").read_text())
    adapter = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    expected = Shape.from_config(json.loads((family_dir(family) / "config.json").read_text())).attention_targets()
    assert summary["status"] == "completed" and summary["train_loss_first"] > 0
    assert saved["target_modules"] == list(expected) and sorted(adapter["target_modules"]) == sorted(expected)
    if family == "phi3":
        assert "target_modules q_proj,k_proj,v_proj,o_proj -> qkv_proj,o_proj" in capsys.readouterr().out


def test_lora_config_and_check_targets_use_the_models_names(family_dir):
    from peft import get_peft_model

    from nb_helpers.config import RunConfig
    from nb_helpers.lora import check_targets, lora_config, trainable_table

    model = build(tiny_config("phi3"), device="cpu")
    with pytest.raises(ConfigError, match=r"\['gate'\] do not exist.*gate_up_proj"):
        check_targets(model, ["gate"])
    peft_model = get_peft_model(model, lora_config(RunConfig(), model))
    assert {row["layer"] for row in trainable_table(peft_model)} == {"qkv_proj", "o_proj"}


def test_families_known_to_the_planner_are_listed():
    from nb_helpers.plan.architecture import known_families

    assert set(TINY) <= set(FAMILIES) and "Phi-4-mini" in known_families()["phi3"]


def test_a_widget_can_plan_each_known_shape():
    from nb_helpers.config import RunConfig
    from nb_helpers.plan.catalog import known_shapes, plan_for_family

    shapes = known_shapes()
    assert {"qwen3-1.7b", "gemma3-1b", "phi-4-mini", "llama-3.2-1b", "tinyllama-1.1b"} <= set(shapes)
    assert "fused qkv_proj" in shapes["phi-4-mini"]
    cfg = RunConfig(max_length=512, budget_gib=4.0)
    small, big = (plan_for_family(cfg, n, context_gib=0.6, gpu_capability=(9, 0)) for n in ("qwen3-0.6b", "qwen3-4b"))
    assert small.fits and small.peak_gib < big.peak_gib and big.shape.name == "qwen3-4b"
    assert plan_for_family(cfg, "phi-4-mini", context_gib=0.3).inputs.targets == ("qkv_proj", "o_proj")
    with pytest.raises(ValueError, match="no shape 'qwen9'"):
        plan_for_family(cfg, "qwen9")


def test_budget_check_skips_a_family_it_cannot_count(monkeypatch, capsys):
    from nb_helpers import preflight
    from nb_helpers.config import RunConfig
    from nb_helpers.models import ModelChoice

    class Gpt2Like:
        model_type = "gpt2"

    monkeypatch.setattr(preflight, "model_config", lambda cfg, choice: Gpt2Like())
    preflight.check_budget_fits(RunConfig(budget_gib=4.0), ModelChoice("x", "x", "t"), 3.0)  # no exception
    assert "cannot check the 4-bit weights" in capsys.readouterr().out
