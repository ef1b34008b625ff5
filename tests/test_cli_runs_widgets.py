import json

import pytest

from nb_helpers.config import RunConfig
from nb_helpers.runs import list_runs, load_run, mark_latest, new_run_dir, resolve_run


def test_help_lists_the_verbs(cli):
    out = cli("--help")
    assert out.returncode == 0
    for verb in ("env", "config", "train", "course"):
        assert verb in out.stdout


def test_config_prints_a_loadable_config(cli):
    out = cli("config", "--set", "lora_r=16")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout[out.stdout.index("{"):])
    assert RunConfig.from_dict(data).lora_r == 16


def test_bad_setting_exits_2_with_the_fix(cli):
    out = cli("train", "--set", "lora_r=0")
    assert out.returncode == 2
    assert "lora_r=0" in out.stderr and "must be >= 1" in out.stderr and "Traceback" not in out.stderr


def test_env_verb_reports_ok_lines(cli):
    out = cli("env", "--no-hub")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[OK  ] bitsandbytes 4-bit" in out.stdout and "Recommended starting config" in out.stdout


def test_run_dirs_latest_and_listing(tmp_path):
    cfg = RunConfig(runs_dir=str(tmp_path))
    a = new_run_dir(cfg, "m/odel name")
    assert "/" not in a.name.split("_", 1)[1] and " " not in a.name
    (a / "config.json").write_text("{}")
    mark_latest(a)
    b = new_run_dir(cfg.replace(run_name=a.name), "x")
    assert b != a and b.name == a.name + "-2"
    (b / "config.json").write_text("{}")
    mark_latest(b)
    assert resolve_run(tmp_path / "latest") == b.resolve()
    assert [p.name for p in list_runs(tmp_path)] == [a.name, b.name]
    with pytest.raises(FileNotFoundError, match="train first"):
        load_run(tmp_path / "nope")


def test_widgets_write_the_config_and_refuse_bad_values():
    from nb_helpers.ui.widgets import TRAIN_FIELDS, config_widgets

    cfg = RunConfig()
    box = config_widgets(cfg, fields=TRAIN_FIELDS)
    controls = {c.description: c for c in box.children[:-1]}
    controls["LoRA rank r"].value = 16
    controls["grad accum"].value = 4
    assert (cfg.lora_r, cfg.grad_accum, cfg.effective_batch) == (16, 4, 4)
    assert "effective batch" in box.children[-1].value
    controls["max steps (-1=epochs)"].value = 5
    cfg.num_train_epochs = 0
    controls["max steps (-1=epochs)"].value = -1  # neither steps nor epochs: refused, value restored
    assert cfg.max_steps == 5 and "nothing trains" in box.children[-1].value
    controls["max steps (-1=epochs)"].value = 0  # 0 (or -5) trained epochs silently: refused too
    assert cfg.max_steps == 5 and "must be -1 (train num_train_epochs instead)" in box.children[-1].value


def test_learning_rate_control_keeps_the_exact_value():
    """A log slider snapped 2e-4 to 1.995e-4 on display; the control must hold exactly what the config holds."""
    from nb_helpers.ui.widgets import TRAIN_FIELDS, config_widgets

    for lr in (2e-4, 4e-4, 7e-4):  # 7e-4 is not among the offered values: it is added, not rounded
        cfg = RunConfig(learning_rate=lr)
        box = config_widgets(cfg, fields=TRAIN_FIELDS)
        control = next(c for c in box.children[:-1] if c.description == "learning rate")
        assert control.value == lr and cfg.learning_rate == lr
        control.value = 1e-4
        assert cfg.learning_rate == 1e-4 and "lr 0.0001" in box.children[-1].value
