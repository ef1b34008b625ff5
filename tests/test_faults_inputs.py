"""The last tracebacks and misleading messages a careful user found: numbers too long to read, settings with no upper
bound, environment variables, read-only and damaged run folders, a link named like the run, a link that loops, a line
of 50 MB, and helpers called with the wrong types. Each is one line naming the problem and the fix, before anything
loads; none needs a model or a training run."""

import errno
import json
import os
import time
import tracemalloc

import pytest

from nb_helpers.config import ConfigError, RunConfig
from nb_helpers.data import DataError, check_jsonl, load_rows

ROW = {"prompt": "q", "completion": "a"}


def refused(result, *needles) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.startswith("error: "), result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)
    return result.stderr


def run_folder(tmp_path, name="a-run"):
    """A run folder as a first start leaves it before training: config.json only."""
    folder = tmp_path / "runs" / name
    folder.mkdir(parents=True)
    RunConfig(runs_dir=str(tmp_path / "runs")).save(folder / "config.json")
    return folder


def read_only_below(monkeypatch, folder):
    """Every write under `folder` fails as on a read-only file system (root writes through chmod, so this is how)."""
    for name in ("open", "mkdir"):
        real = getattr(os, name)

        def read_only(path, *args, _real=real, **kwargs):
            if os.fspath(path).startswith(str(folder)) and (name == "mkdir" or (args and args[0] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))):
                raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
            return _real(path, *args, **kwargs)

        monkeypatch.setattr(os, name, read_only)


# --- numbers too long to read, and settings with no upper bound ---------------------------------------------------

def test_an_integer_of_5000_digits_in_set_is_one_line(cli):
    message = refused(cli("config", "--set", "lora_r=" + "9" * 5000), "--set lora_r=<5000 characters>",
                      "a number too long to read")
    assert len(message) < 300


def test_an_integer_of_5000_digits_in_a_data_row_is_a_row_problem(cli, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + '{"prompt": "q", "completion": "a", "n": ' + "7" * 5000 + "}\n")
    result = cli("validate-data", path)
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
    assert ":2: error: a number too long to read" in result.stdout, result.stdout[-800:]


def test_a_401_digit_number_for_a_float_knob_is_not_finite(cli):
    message = refused(cli("config", "--set", "learning_rate=1" + "0" * 400),
                      "learning_rate=<a 401-digit number>: not a finite number")
    assert "0" * 100 not in message


@pytest.mark.parametrize("knob, value, needle", [
    ("lora_r", 1000000000, "the LoRA rank must be >= 1 (and at most 1024"),
    ("max_length", 10**9, "and at most 131,072 tokens"),
    ("micro_batch_size", 10**6, "must be >= 1 (and at most 1024)"),
    ("max_steps", 10**12, "must be -1 (train num_train_epochs instead) or 1 .. 1,000,000"),
    ("max_steps", -5, "must be -1 (train num_train_epochs instead)"),  # trained epochs silently
    ("max_steps", 0, "must be -1 (train num_train_epochs instead)"),
    ("max_new_tokens", 10**7, "(and at most 131,072) tokens per answer"),
    ("learning_rate", 50.0, "at most 1"),
])
def test_every_setting_has_an_upper_bound(knob, value, needle):
    with pytest.raises(ConfigError) as err:
        RunConfig(**{knob: value}).validate()
    assert f"{knob}={value!r}: " in str(err.value) and needle in str(err.value)


# --- environment variables ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, value, needle", [
    ("NB_FASTPATH", "xyz", "NB_FASTPATH='xyz': 'xyz' is not LEVER=0 or LEVER=1"),
    ("NB_FASTPATH", "kernels=maybe", "'kernels=maybe' is not LEVER=0 or LEVER=1"),
    ("WORLD_SIZE", "abc", "WORLD_SIZE='abc': must be a whole number >= 1"),
    ("LOCAL_RANK", "-1", "LOCAL_RANK='-1': must be a whole number >= 0"),
    ("NB_CACHE_DIR", "/dev/null/x", "NB_CACHE_DIR='/dev/null/x': /dev/null is a file, not a folder"),
])
def test_each_environment_variable_is_checked_in_one_line(cli, monkeypatch, name, value, needle):
    monkeypatch.setenv(name, value)
    message = refused(cli("config"), "error: environment: ", needle)
    assert message.count("\n") == 1, message


def test_prepare_run_checks_the_environment_too(monkeypatch, tiny_cfg):
    from nb_helpers import training

    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="WORLD_SIZE='two': must be a whole number"):
        training.prepare_run(tiny_cfg, verbose=False)


# --- run folders: read-only, a summary that is not JSON, a link named like the run --------------------------------

def test_a_read_only_run_folder_on_resume_is_found_before_the_lock(cli, tmp_path, monkeypatch):
    folder = run_folder(tmp_path)
    read_only_below(monkeypatch, folder)
    refused(cli("train", "--resume", folder), f"--resume={str(folder)!r}: the run cannot write there (the file system "
                                              "is read-only)")
    assert not (folder / "run.lock").exists()


def test_a_summary_that_is_not_json_on_resume_is_one_line(cli, tmp_path):
    folder = run_folder(tmp_path)
    (folder / "summary.json").write_text("{ half a summ")
    refused(cli("train", "--resume", folder), f"{folder / 'summary.json'} cannot be read as JSON",
            "Delete it (a resume writes it again)")
    assert not (folder / "run.lock").exists()


def test_resume_of_a_folder_that_is_not_there_is_one_line(cli, tmp_path):
    refused(cli("train", "--resume", tmp_path / "nothing"), "no such run folder")


def test_a_dangling_link_named_like_the_run_is_stepped_around(tmp_path, capsys):
    from nb_helpers.runs import new_run_dir

    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "mine").symlink_to(tmp_path / "gone")
    made = new_run_dir(RunConfig(runs_dir=str(tmp_path / "runs"), run_name="mine"), "m")
    assert made == tmp_path / "runs" / "mine-2" and made.is_dir()
    assert "exists; writing to" in capsys.readouterr().out


def test_export_into_a_read_only_run_folder_stops_before_merging(cli, tmp_path, monkeypatch):
    from nb_helpers import export

    folder = run_folder(tmp_path)
    read_only_below(monkeypatch, folder)
    monkeypatch.setattr(export, "merge_adapter", lambda *a, **k: pytest.fail("merged before the check"))
    refused(cli("export", "--run", folder), f"--run {folder}: export cannot write into the run folder")


def test_export_with_merged_a_file_stops_before_claiming_it_saved(cli, tmp_path, monkeypatch):
    from nb_helpers import export

    folder = run_folder(tmp_path)
    (folder / "merged").write_text("a file where the merged model goes")
    monkeypatch.setattr(export, "merge_adapter", lambda *a, **k: pytest.fail("merged before the check"))
    result = cli("export", "--run", folder)
    refused(result, f"{folder / 'merged'} is a file: export writes the merged folder there")
    assert "merged 16-bit model" not in result.stdout


# --- data files: a link that loops, a line of 50 MB ---------------------------------------------------------------

def test_a_train_file_link_that_loops_says_so(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(DataError) as err:
        load_rows(str(loop), RunConfig(train_file=str(loop)))
    message = str(err.value)
    assert "a symbolic link that leads to no file (it loops back on itself)" in message and "Did you mean" not in message


def test_a_line_of_50_mb_is_checked_in_bounded_memory_and_time(tmp_path, cli):
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps(ROW) + "\n")
        f.write('{"prompt": "' + "x" * 50_000_000 + '", "completion": "a"}\n')
        f.write(json.dumps({"prompt": "q2", "completion": "a2"}) + "\n")
    tracemalloc.start()
    start = time.perf_counter()
    report = check_jsonl(path)
    seconds, (_, peak) = time.perf_counter() - start, tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert report.lines == [1, 3] and [p.line for p in report.errors] == [2]
    assert "50.0 MB on one line, more than any row can train on" in report.errors[0].problem
    assert peak < 8 * 2**20 and seconds < 10, (peak, seconds)


# --- helpers given the wrong types --------------------------------------------------------------------------------

def test_helpers_given_the_wrong_types_say_what_they_take(tmp_path):
    from nb_helpers.runs import list_runs, load_run
    from nb_helpers.training import train

    with pytest.raises(ConfigError, match=r"give a RunConfig, e.g. default_config\(\)"):
        train("config.json")
    with pytest.raises(ConfigError, match=r"load_rows\(123, RunConfig\): give a file path"):
        load_rows(123, RunConfig())
    with pytest.raises(ConfigError, match=r"load_rows\('data/eval.jsonl', dict\): give a file path"):
        load_rows("data/eval.jsonl", {"max_length": 512})
    with pytest.raises(DataError, match=r"check_jsonl\(5\): give the path of a JSONL file"):
        check_jsonl(5)
    with pytest.raises(ConfigError, match=r"5 \(int\) is not a run folder"):
        load_run(5)
    with pytest.raises(ConfigError, match=r"list_runs\(None\): give the runs folder"):
        list_runs(None)


def test_no_numeric_setting_takes_any_number_however_large():
    """A bound on every number knob, not a list to keep up: a knob added without one fails here."""
    import dataclasses

    from nb_helpers.config import knob_types

    numeric = [f.name for f in dataclasses.fields(RunConfig) if knob_types(RunConfig)[f.name][0] in (int, float)]
    assert "lora_r" in numeric and "learning_rate" in numeric
    unbounded = []
    for knob in numeric:
        try:
            RunConfig(**{knob: 10**15}).validate()
            unbounded.append(knob)
        except ConfigError as e:
            assert f"{knob}=1000000000000000" in str(e), (knob, str(e))
    assert not unbounded, f"no upper bound in nb_helpers.config.RANGES for {unbounded}"
