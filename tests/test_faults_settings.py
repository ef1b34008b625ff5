"""Every bad setting and input gets a clear message before anything loads (issue 25, items 5, 9, 10, 11, 12, 13).

Each case is one the testers found: a traceback, a minute of network retries, a run that crashed after the weights
had loaded, or a wrong value that trained silently. Command-line cases go through the `cli` fixture: a non-zero exit,
a message naming the knob or file and the fix, and no traceback. Nothing here touches the network.
"""

import codecs
import json
import math
import os
import subprocess
import sys

import pytest

from nb_helpers.config import PROJECT_ROOT, ConfigError, RunConfig, default_config
from nb_helpers.data import DataError, check_jsonl, load_rows

ROW = {"prompt": "q", "completion": "a"}


def refused(result, *needles) -> str:
    """The CLI refused with one message holding every needle, and no traceback; that message."""
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.startswith("error: "), result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)
    return result.stderr


def write_lines(path, *lines, prefix=b"", end=b"\n"):
    path.write_bytes(prefix + b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + end
                                       for line in lines))
    return path


# --- 5: a UTF-8 byte order mark (Windows editors) ------------------------------------------------------------

@pytest.mark.parametrize("end", [b"\n", b"\r\n"], ids=["LF", "CRLF"])
def test_a_byte_order_mark_is_read_like_any_utf8_file(tmp_path, cli, end):
    path = write_lines(tmp_path / "bom.jsonl", ROW, {"prompt": "q2", "completion": "a2"}, prefix=codecs.BOM_UTF8,
                       end=end)
    report = check_jsonl(path)
    assert not report.problems and report.lines == [1, 2], report.text()
    assert [r["prompt"][0]["content"] for r in load_rows(str(path), RunConfig())] == ["q", "q2"]  # training's loader
    checked = cli("validate-data", path)
    assert checked.returncode == 0 and "2 usable rows, 0 error(s)" in checked.stdout, checked.stdout


def test_config_files_with_a_byte_order_mark_load(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    path.write_bytes(codecs.BOM_UTF8 + json.dumps({"lora_r": 16}).encode())
    assert RunConfig.load(path).lora_r == 16
    monkeypatch.setenv("NB_CONFIG", str(path))
    assert default_config().lora_r == 16


# --- 9: offline decided before the hub libraries read it; local-looking names never go to the Hub --------------

def test_offline_is_decided_at_the_first_import_before_the_hub_library_reads_it():
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    # the probe goes through a proxy on a closed local port: refused at once, no network touched
    env.update(https_proxy="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9", no_proxy="", NO_PROXY="")
    code = ("import os, nb_helpers; from huggingface_hub import constants; "
            "print(constants.HF_HUB_OFFLINE, os.environ.get('HF_HUB_OFFLINE'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=PROJECT_ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.stdout.split() == ["True", "1"], out.stdout + out.stderr


def test_offline_also_reaches_a_hub_library_imported_first_and_a_users_choice_stands(monkeypatch):
    from huggingface_hub import constants

    from nb_helpers import hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setitem(hub._decided, "reason", "")
    hub.decide_offline(probe=lambda: False)
    assert os.environ["HF_HUB_OFFLINE"] == "1" and constants.HF_HUB_OFFLINE is True
    assert "did not answer" in hub.offline_reason()

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # set by the user, to anything: never probed, never changed
    hub.decide_offline(probe=lambda: pytest.fail("probed the Hub although HF_HUB_OFFLINE was set"))
    assert os.environ["HF_HUB_OFFLINE"] == "0"


def test_a_hub_model_id_while_offline_is_one_line(cli):
    message = refused(cli("train", "--set", "model=someorg/no-such-model"), "model='someorg/no-such-model'",
                      "not in the Hugging Face cache", "offline", "local folder")
    assert len(message.strip().splitlines()) == 1


def test_a_mistyped_data_path_is_not_looked_up_on_the_hub(cli, tiny_model_dir, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("looked up on the Hub"))
    with pytest.raises(DataError) as err:
        load_rows("data/trian", RunConfig(train_file="data/trian"))
    assert "train_file='data/trian': no such file" in str(err.value)
    assert "Did you mean 'data/train.jsonl'?" in str(err.value)
    refused(cli("train", "--set", f"model={tiny_model_dir}", "--set", "train_file=data/trian"),
            "train_file='data/trian': no such file", str(PROJECT_ROOT / "data" / "trian"), "data/train.jsonl")


def test_a_hub_dataset_while_offline_is_one_line(monkeypatch):
    import datasets

    from nb_helpers import hub

    def offline_hub(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'someorg/somedata' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline_hub)
    monkeypatch.setattr(hub, "offline", lambda: True)
    with pytest.raises(DataError) as err:
        load_rows("someorg/somedata", RunConfig(train_file="someorg/somedata"))
    assert "train_file='someorg/somedata': no local file" in str(err.value) and "the Hub is offline" in str(err.value)


# --- 10: every knob checked for type, range and finiteness --------------------------------------------------

@pytest.mark.parametrize("knob, value, fix", [
    ("lora_r", "abc", "must be a whole number"),
    ("lora_r", 8.5, "must be a whole number"),
    ("lora_r", True, "must be a whole number"),  # to Python True is 1: it trained r=1
    ("micro_batch_size", 2.5, "must be a whole number"),
    ("learning_rate", math.nan, "not a finite number"),
    ("learning_rate", math.inf, "not a finite number"),  # trained into NaN, then blamed fp16
    ("max_grad_norm", math.nan, "not a finite number"),  # turned clipping off
    ("num_train_epochs", math.nan, "not a finite number"),
    ("warmup_steps", -5, "must be >= 0"),
    ("logging_steps", 0, "must be >= 1"),
    ("lr_scheduler_type", "cosinus", "not a transformers scheduler"),
    ("max_train_samples", -3, "None for every row"),  # dropped rows silently
    ("target_modules", "q_proj", 'write ["q_proj"]'),  # was split into the layers q, _, p, r, o, j
    ("gradient_checkpointing", "no", "must be true/false"),
    ("budget_gib", math.inf, "not a finite number"),
])
def test_each_bad_value_names_the_knob_the_value_and_a_fix(knob, value, fix):
    with pytest.raises(ConfigError) as err:
        RunConfig(**{knob: value}).validate()
    assert f"{knob}={value!r}" in str(err.value) and fix in str(err.value)


def test_every_problem_is_listed_at_once_and_the_examples_are_the_defaults():
    with pytest.raises(ConfigError) as err:
        RunConfig(lora_r="abc", learning_rate=math.nan, target_modules="q_proj,v_proj", seed=-1).validate()
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 4, err.value
    assert f"e.g. lora_r={RunConfig().lora_r}" in lines[0]
    assert 'write ["q_proj", "v_proj"]' in str(err.value)


def test_transformers_schedulers_are_the_ones_accepted():
    from transformers.trainer_utils import SchedulerType

    for scheduler in SchedulerType:
        RunConfig(lr_scheduler_type=scheduler.value).validate()
    with pytest.raises(ConfigError, match="lr_scheduler_type='cosinus'"):
        RunConfig(lr_scheduler_type="cosinus").validate()


def test_set_values_go_through_the_same_checks(cli):
    message = refused(cli("train", "--set", "lora_r=abc", "--set", "learning_rate=NaN", "--set", "target_modules=q_proj",
                          "--set", "lora_alpha=true"),
                      "lora_r='abc'", "learning_rate=nan", 'write ["q_proj"]', "lora_alpha=True")
    assert message.count("\n  - ") == 4


def test_config_files_go_through_the_same_checks(cli, tmp_path, monkeypatch, tiny_model_dir):
    path = tmp_path / "run.json"
    path.write_text('{"max_grad_norm": NaN, "budget_gib": 4.0}')  # Python's json writes NaN as a bare word
    refused(cli("plan", "--config", path, "--model", tiny_model_dir), "max_grad_norm=nan: not a finite number")
    path.write_text(json.dumps({"lora_r": True}))
    monkeypatch.setenv("NB_CONFIG", str(path))
    refused(cli("config"), "lora_r=True")


# --- 11: rows that would all be dropped stop in data loading; validate-data uses the run's max_length ----------

def long_prompt_rows(path, count=3, words=120):
    return write_lines(path, *({"prompt": f"question {i}: " + "word " * words, "completion": f"answer {i}"}
                               for i in range(count)))


def test_rows_that_would_all_be_dropped_stop_before_the_weights_load(tiny_cfg, tmp_path, monkeypatch):
    from nb_helpers import training
    from nb_helpers.data import longest_row_tokens
    from nb_helpers.models import load_tokenizer

    monkeypatch.setattr(training, "load_4bit", lambda *a, **k: pytest.fail("model loaded although no row trains"))
    path = long_prompt_rows(tmp_path / "long.jsonl")
    cfg = tiny_cfg.replace(train_file=str(path), max_length=64)
    with pytest.raises(DataError) as err:
        training.train(cfg, verbose=False)
    longest = longest_row_tokens(load_rows(str(path), cfg), load_tokenizer(cfg.model))
    assert longest > 64
    assert "all 3 rows would be dropped" in str(err.value) and "max_length 64" in str(err.value)
    assert f"the longest row has {longest} tokens" in str(err.value) and f"Raise max_length to {longest}" in str(err.value)
    runs = cfg.resolve_path(cfg.runs_dir)
    assert not runs.exists() or not any(runs.rglob("config.json")) and not (runs / "latest").exists()


def test_validate_data_counts_against_the_max_length_the_run_uses(cli, tmp_path):
    path = long_prompt_rows(tmp_path / "long.jsonl", count=1, words=40)
    run_length = default_config().max_length
    default = cli("validate-data", path)
    assert f"against max_length {run_length}, from the config `train` runs" in default.stdout, default.stdout
    lowered = cli("validate-data", path, "--set", "max_length=32")
    assert lowered.returncode == 0 and "over max_length 32" not in lowered.stdout  # the prompt alone fills it
    assert "fills max_length 32, so the whole answer is cut" in lowered.stdout, lowered.stdout
    assert "against max_length 32" in lowered.stdout


# --- 12: validate-data never tracebacks on row content --------------------------------------------------------

def test_a_lone_surrogate_is_a_row_problem_not_a_traceback(tmp_path, cli):
    path = write_lines(tmp_path / "s.jsonl", ROW, {"prompt": "q\ud800", "completion": "a"},
                       {"prompt\udfff": "q", "completion": "a"})  # json.dumps writes the half as \ud800
    report = check_jsonl(path)
    assert [(p.line, p.severity) for p in report.problems] == [(2, "error"), (3, "error")], report.text()
    assert "\\ud800, half of a UTF-16 pair" in report.problems[0].problem and "\\udfff" in report.problems[1].problem
    checked = cli("validate-data", path)
    assert checked.returncode == 1 and "Traceback" not in checked.stdout + checked.stderr
    assert f"{path}:2: error: holds \\ud800" in checked.stdout and f"{path}:3: error: holds \\udfff" in checked.stdout


def test_deeply_nested_brackets_are_a_row_problem_not_a_traceback(tmp_path, cli):
    depth = max(sys.getrecursionlimit() * 2, 100_000)  # past Python 3.12's C recursion limit too (2,000 parse there)
    path = write_lines(tmp_path / "deep.jsonl", ROW, b"[" * depth + b"]" * depth)
    checked = cli("validate-data", path)
    assert checked.returncode == 1 and "Traceback" not in checked.stdout + checked.stderr
    assert f"{path}:2: error: brackets nested too deeply to read — fix or remove this line" in checked.stdout


# --- 13: small inputs of the command line -------------------------------------------------------------------

def test_bad_config_paths_are_one_line(cli, tmp_path):
    number = tmp_path / "number.json"
    number.write_text("5")
    refused(cli("train", "--config", "5"), "5: cannot read it", "python -m nb_helpers config -o FILE")
    refused(cli("train", "--config", tmp_path), f"{tmp_path}: cannot read it")
    refused(cli("train", "--config", number), f"{number}: holds 5, not an object of knobs")


@pytest.mark.parametrize("content, needle", [(None, "cannot read it"), ("{lora_r: 16", "not valid JSON"),
                                             ("[1, 2]", "holds [1, 2], not an object")])
def test_a_bad_nb_config_is_one_line(cli, tmp_path, monkeypatch, content, needle):
    path = tmp_path / "overrides.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv("NB_CONFIG", str(path))
    refused(cli("config"), f"NB_CONFIG={path}: {needle}", "unset NB_CONFIG")


def test_a_bad_gpu_capability_is_one_line(cli, tiny_model_dir):
    refused(cli("plan", "--model", tiny_model_dir, "--gpu-capability", "abc"), "--gpu-capability 'abc'", "7.5")


def test_clean_notebooks_on_a_bad_path_rewrites_nothing(cli, tmp_path):
    import nbformat

    good = tmp_path / "good.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1", execution_count=3)])
    nbformat.write(nb, good)
    before = good.read_bytes()
    refused(cli("clean-notebooks", good, tmp_path / "missing.ipynb"), "missing.ipynb: cannot read it as a notebook")
    assert good.read_bytes() == before  # read all first: nothing rewritten
    (tmp_path / "five.ipynb").write_text("5")
    refused(cli("clean-notebooks", tmp_path / "five.ipynb"), "five.ipynb: cannot read it as a notebook")
