import json

import pytest

from nb_helpers.config import CI_OVERRIDES, ConfigError, RunConfig, default_config


def test_defaults_are_the_reference_recipe():
    cfg = RunConfig()
    assert (cfg.quant_type, cfg.double_quant) == ("nf4", True)
    assert (cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout) == (8, 16, 0.05)
    assert cfg.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert (cfg.micro_batch_size, cfg.grad_accum, cfg.effective_batch) == (1, 8, 8)
    assert (cfg.optim, cfg.learning_rate, cfg.max_grad_norm) == ("paged_adamw_8bit", 2e-4, 0.3)
    assert cfg.gradient_checkpointing and cfg.num_train_epochs == 3 and cfg.max_steps == -1
    assert cfg.trust_remote_code is False
    # CUDA graphs: auto-fit weighs them; the recipe's settings, as set, run the lean eager path
    assert cfg.cuda_graphs is None and not cfg.graphs_wanted and cfg.replace(auto_fit=True).graphs_wanted


@pytest.mark.parametrize("change, knob", [
    ({"lora_r": 0}, "lora_r"), ({"lora_r": -4}, "lora_r"), ({"lora_alpha": 0}, "lora_alpha"),
    ({"lora_dropout": 1.0}, "lora_dropout"), ({"lora_dropout": -0.1}, "lora_dropout"),
    ({"grad_accum": 0}, "grad_accum"), ({"micro_batch_size": 0}, "micro_batch_size"),
    ({"learning_rate": 0}, "learning_rate"), ({"target_modules": []}, "target_modules"),
    ({"compute_dtype": "float8"}, "compute_dtype"), ({"optim": "adamw_9bit"}, "optim"),
    ({"budget_gib": 0}, "budget_gib"), ({"max_steps": -1, "num_train_epochs": 0}, "max_steps"),
    ({"cuda_graphs": "yes"}, "cuda_graphs"),
])
def test_invalid_settings_name_the_knob_and_the_fix(change, knob):
    with pytest.raises(ConfigError) as err:
        RunConfig(**change).validate()
    assert knob in str(err.value)


def test_save_load_round_trip(tmp_path):
    cfg = RunConfig(lora_r=16, target_modules=["q_proj", "v_proj"], budget_gib=4.0)
    cfg.save(tmp_path / "c.json")
    assert RunConfig.load(tmp_path / "c.json") == cfg


def test_unknown_key_and_bad_json_are_explained(tmp_path):
    with pytest.raises(ConfigError, match="unknown config keys \\['lora_rank'\\]"):
        RunConfig.from_dict({"lora_rank": 8})
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        RunConfig.load(tmp_path / "bad.json")


def test_replace_validates():
    with pytest.raises(ConfigError):
        RunConfig().replace(lora_r=0)
    assert RunConfig().replace(lora_r=16).lora_r == 16


def test_cpu_profile_keeps_the_effective_batch(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = default_config()
    assert cfg.effective_batch == RunConfig().effective_batch
    assert (cfg.micro_batch_size, cfg.grad_accum) == (4, 2)  # measured: as fast as 8 x 1 for SFT, faster for DPO
    assert "no CUDA GPU" in capsys.readouterr().out


def test_ci_switch_and_config_file(monkeypatch, tmp_path, capsys):
    (tmp_path / "o.json").write_text(json.dumps({"lora_r": 4, "lora_alpha": 8}))
    monkeypatch.setenv("NB_CONFIG", str(tmp_path / "o.json"))
    monkeypatch.setenv("NB_CI", "1")
    cfg = default_config(seed=7)
    assert cfg.lora_r == 4 and cfg.seed == 7
    assert cfg.max_steps == CI_OVERRIDES["max_steps"] and cfg.runs_dir == "runs/ci"
    out = capsys.readouterr().out
    assert "NB_CI=1" in out and "NB_CONFIG" in out


def test_relative_paths_resolve_against_the_project_root():
    from nb_helpers.config import PROJECT_ROOT

    assert RunConfig().resolve_path("data/train.jsonl") == PROJECT_ROOT / "data" / "train.jsonl"
