"""A run is never lost: a kill during a save, a full or read-only disk, a run_name that is a path, two processes on
one run folder, SIGTERM, a kill before finish_run, a torn metrics line. Faults are injected in-process (monkeypatch,
a listener that raises or signals at a given step) on the tiny model of conftest.py."""

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from nb_helpers.config import PROJECT_ROOT, ConfigError, RunConfig


class Killed(Exception):
    """Stands in for kill -9: training stops at once and finish_run never runs (no summary.json, no adapter)."""


def raise_at(step, error):
    def listener(record):
        if record.get("step") == step and "loss" in record:
            raise error
    return listener


def summary_of(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def newest_run(cfg):
    return (cfg.resolve_path(cfg.runs_dir) / "latest").resolve()


def copy_run(run_dir, tmp_path):
    copy = tmp_path / "runs" / run_dir.name
    shutil.copytree(run_dir, copy)
    return copy


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def hold_run_lock(run_dir):
    """Another process that takes the run's lock, as a run opening its folder does, and keeps it until it is killed."""
    code = ("import sys, time\nfrom nb_helpers.faults.run_lock import take_run_lock\ntake_run_lock(sys.argv[1])\n"
            "print('held', flush=True)\ntime.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], cwd=PROJECT_ROOT, stdout=subprocess.PIPE,
                              text=True)
    if not any(line.strip() == "held" for line in holder.stdout):
        raise AssertionError(f"the holder ended without taking the lock (exit {holder.wait()})")
    return holder


@pytest.fixture(scope="module")
def killed_run(tiny_model_dir, tmp_path_factory, make_tiny_config):
    """A run killed at step 3 (after checkpoint-2, before finish_run), as kill -9 leaves it."""
    from nb_helpers.training import train

    cfg = make_tiny_config(tiny_model_dir, tmp_path_factory.mktemp("killed") / "runs")
    with pytest.raises(Killed):
        train(cfg, listeners=[raise_at(3, Killed())], verbose=False)
    run_dir = newest_run(cfg)
    assert not (run_dir / "summary.json").exists() and (run_dir / "checkpoints" / "checkpoint-2").is_dir()
    return run_dir


# --- 1. a checkpoint cut short is never resumed from ------------------------------------------------------------

def test_resume_skips_checkpoints_cut_short_and_moves_a_torn_metrics_line(killed_run, tmp_path, capsys):
    from nb_helpers.metrics import read_metrics
    from nb_helpers.training import train

    run_dir = copy_run(killed_run, tmp_path)
    folder = run_dir / "checkpoints"
    half = folder / "checkpoint-3"  # killed while writing optimizer.pt
    shutil.copytree(folder / "checkpoint-2", half)
    state = json.loads((half / "trainer_state.json").read_text())
    (half / "trainer_state.json").write_text(json.dumps({**state, "global_step": 3}))
    optimizer = (half / "optimizer.pt").read_bytes()
    (half / "optimizer.pt").write_bytes(optimizer[: len(optimizer) // 2])
    (folder / "checkpoint-4").mkdir()  # killed right after the Trainer made the folder
    torn = len((run_dir / "metrics.jsonl").read_text().splitlines()) + 1
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "epoch": 1.0, "lo')  # killed while writing this line

    resumed = train(RunConfig(), resume_from=run_dir, verbose=False)
    out = capsys.readouterr().out
    assert "skipping checkpoint-4: trainer_state.json is missing or cut short" in out
    assert "skipping checkpoint-3: optimizer.pt is cut short or damaged" in out
    assert "resuming" in out and "from checkpoint-2" in out
    assert sorted(p.name for p in (folder / "incomplete").iterdir()) == ["checkpoint-3", "checkpoint-4"]
    assert summary_of(resumed)["status"] == "completed"
    from nb_helpers.faults.checkpoints import checkpoint_problem

    assert checkpoint_problem(folder / "checkpoint-3") is None  # written again, whole
    assert [r["step"] for r in read_metrics(resumed / "metrics.jsonl") if "loss" in r] == [1, 2, 3]
    moved = (run_dir / "metrics.unreadable.txt").read_text()
    assert moved == f'metrics.jsonl:{torn}: {{"step": 4, "epoch": 1.0, "lo\n'  # kept as it was, with where
    assert "metrics.unreadable.txt" in out


def test_checkpoints_are_published_whole_and_a_failed_save_leaves_nothing(tiny_cfg, monkeypatch):
    """The Trainer writes into checkpoints/saving/; only a whole checkpoint is renamed to checkpoint-N."""
    import torch

    from nb_helpers.recovery import last_checkpoint
    from nb_helpers.training import train

    real_save = torch.save

    def disk_fills_at_checkpoint_2(obj, path, *args, **kwargs):
        if "checkpoint-2" in str(path):
            with open(path, "wb") as f:
                f.write(b"PK\x03\x04 half an archive")
            raise Exception("No space left on device (os error 28)")  # as safetensors and the Rust writers say it
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_fills_at_checkpoint_2)
    with pytest.raises(ConfigError) as err:  # a WriteFailed: the command line prints it without a traceback
        train(tiny_cfg.replace(save_steps=1, task_eval_samples=0), verbose=False)
    run_dir = newest_run(tiny_cfg)
    message = str(err.value)
    assert "could not save a checkpoint" in message and "the disk is full" in message and "df -h" in message
    assert "the last complete checkpoint (checkpoint-1) is intact" in message and f"--resume {run_dir}" in message
    assert summary_of(run_dir)["status"] == "save failed"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["checkpoint-1"]  # no partial, no saving/
    assert last_checkpoint(run_dir).name == "checkpoint-1"  # complete (last_checkpoint checks)


# --- 2. every failed write, whatever raised it ------------------------------------------------------------------

@pytest.mark.parametrize("error, cause", [
    (Exception("No space left on device (os error 28)"), "the disk is full"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "disk quota is used up"),
    (RuntimeError("[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file data/0: file "
                  "write failed"), "most often a full disk"),
    (Exception("Read-only file system (os error 30)"), "read-only"),
    (PermissionError(errno.EACCES, "Permission denied"), "permission was denied"),
])
def test_write_failures_are_told_apart_by_errno_or_message(error, cause, tmp_path):
    from nb_helpers.faults.write_errors import WriteFailed, as_write_failure, write_cause

    assert cause in write_cause(error)[0]
    try:
        raise ValueError("wrapped") from error
    except ValueError as wrapper:
        assert cause in write_cause(wrapper)[0]  # found where a library re-raised it
    failure = as_write_failure(error, tmp_path, "the adapter")
    assert isinstance(failure, WriteFailed) and isinstance(failure, ConfigError) and cause in str(failure)
    assert "no checkpoint was complete yet" in str(failure) and "start the run again" in str(failure)
    other = ValueError("shapes do not match")
    assert write_cause(other) is None and as_write_failure(other, tmp_path, "x") is other


def test_a_full_disk_on_the_adapter_is_a_message_on_the_command_line(tiny_cfg, tmp_path, cli, monkeypatch):
    """safetensors reports a full disk as a bare Exception: the CLI user gets the advice, not a traceback, and the
    summary says what happened."""
    from peft import peft_model

    real = peft_model.safe_save_file

    def full_disk_on_the_adapter(tensors, path, *args, **kwargs):
        if "adapter.partial" in str(path):
            open(path, "wb").write(b"\x00" * 10)
            raise Exception("No space left on device (os error 28)")
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(peft_model, "safe_save_file", full_disk_on_the_adapter)
    config = tmp_path / "tiny.json"
    tiny_cfg.replace(max_steps=1, save_steps=50, task_eval_samples=0).save(config)
    result = cli("train", "--config", config)
    run_dir = newest_run(tiny_cfg)
    assert result.returncode != 0 and "Traceback" not in result.stdout + result.stderr
    assert "could not save the adapter" in result.stderr and "the disk is full" in result.stderr
    assert summary_of(run_dir)["status"] == "save failed"
    assert not (run_dir / "adapter.partial").exists() and not (run_dir / "adapter").exists()


def test_a_read_only_runs_dir_is_found_before_the_model_loads(tiny_cfg, monkeypatch):
    from nb_helpers import training

    runs = str(tiny_cfg.resolve_path(tiny_cfg.runs_dir))
    for name in ("open", "mkdir"):
        real = getattr(os, name)

        def read_only(path, *args, _real=real, **kwargs):
            if os.fspath(path).startswith(runs):
                raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
            return _real(path, *args, **kwargs)

        monkeypatch.setattr(os, name, read_only)
    monkeypatch.setattr(training, "load_4bit", lambda *a, **k: pytest.fail("the model loaded before the check"))
    with pytest.raises(ConfigError, match=r"runs_dir=.*the run cannot write there \(the file system is read-only\); "
                                          r"set runs_dir to a folder you can write"):
        training.train(tiny_cfg, verbose=False)


# --- 3. run_name is a folder name, and runs/latest only ever replaces what the course wrote ------------------------

@pytest.mark.parametrize("name", ["../escaped", "/tmp/elsewhere", "latest", "..", "a/b", "my run", "-rf", ".hidden",
                                  "CON", "nul.txt", "com1"])
def test_run_name_must_be_a_plain_folder_name(tiny_cfg, name, monkeypatch):
    from nb_helpers import training

    monkeypatch.setattr(training, "load_tokenizer", lambda *a, **k: pytest.fail("loading began before the check"))
    with pytest.raises(ConfigError, match=r"run_name=.*plain folder name of letters, digits"):
        training.prepare_run(tiny_cfg.replace(run_name=name), verbose=False)
    assert not (tiny_cfg.resolve_path(tiny_cfg.runs_dir).parent / "escaped").exists()


def test_plain_names_that_only_look_unusual_are_taken():
    from nb_helpers.runs import check_run_name

    for name in ("r16-lr1e-4", "_draft", "v1.2", "console", "nul-run", "a" * 100):
        check_run_name(name)  # no error


def test_counts_given_on_the_command_line_or_to_load_rows_are_never_negative(cli, tiny_cfg):
    from nb_helpers.data import load_rows

    for args in (("validate-data", "data/train.jsonl", "--limit", "-1"), ("export", "--prompts", "-3"),
                 ("validate-data", "data/train.jsonl", "--limit", "two")):
        result = cli(*args)
        assert result.returncode == 2 and "give 0 or more" in result.stderr and "Traceback" not in result.stderr, args
    with pytest.raises(ConfigError, match=r"load_rows\(limit=-3\): give a whole number of rows, 0 or more"):
        load_rows("data/eval.jsonl", tiny_cfg, -3)
    assert len(load_rows("data/eval.jsonl", tiny_cfg, 2)) == 2


def test_latest_replaces_only_a_link_or_its_own_text_file(tmp_path, capsys):
    from nb_helpers.runs import mark_latest, resolve_run

    run = tmp_path / "run-a"
    run.mkdir()
    latest = tmp_path / "latest"
    latest.mkdir()  # a real folder named latest
    (latest / "notes.txt").write_text("mine")
    mark_latest(run)
    assert (latest / "notes.txt").read_text() == "mine" and "left alone" in capsys.readouterr().out
    shutil.rmtree(latest)
    latest.write_text("my results, do not delete\n")  # a foreign file
    mark_latest(run)
    assert latest.read_text() == "my results, do not delete\n" and "left alone" in capsys.readouterr().out
    latest.write_text("run-0")  # the text file mark_latest writes where symlinks are not allowed
    mark_latest(run)
    assert resolve_run(latest) == run.resolve()


# --- 4. one process per run folder ------------------------------------------------------------------------------

def test_a_second_process_on_a_run_is_refused_with_who_holds_it(killed_run, tmp_path, cli, monkeypatch):
    from nb_helpers import training

    run_dir = copy_run(killed_run, tmp_path)
    holder = hold_run_lock(run_dir)
    try:
        monkeypatch.setattr(training, "load_4bit", lambda *a, **k: pytest.fail("the model loaded on a locked run"))
        result = cli("train", "--resume", run_dir)
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"is being trained by process {holder.pid} on {socket.gethostname()}" in result.stderr
    assert "Wait for it to finish" in result.stderr and "run.lock" in result.stderr
    assert json.loads((run_dir / "run.lock").read_text())["pid"] == holder.pid  # another's lock is never removed


def test_a_stale_lock_is_taken_over_and_released_at_the_end(tmp_path, capsys):
    from nb_helpers.faults.run_lock import release_run_lock, take_run_lock

    lock = tmp_path / "run.lock"
    lock.write_text(json.dumps({"pid": 1, "host": "another-machine"}))  # a shared folder: not checkable, refused
    with pytest.raises(ConfigError, match="on another-machine .*, another machine.*delete"):
        take_run_lock(tmp_path)
    for stale in ({"pid": dead_pid(), "host": socket.gethostname()},):
        lock.write_text(json.dumps(stale))
        take_run_lock(tmp_path)
        assert f"process {stale['pid']} on {stale['host']}" in capsys.readouterr().out
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        take_run_lock(tmp_path)  # the same process again (a notebook re-running a cell): still its own
        release_run_lock(tmp_path)
        assert not lock.exists()


def test_a_lock_whose_process_was_killed_does_not_block(tmp_path, capsys):
    """kill -9 of the process that holds a run: the OS lets go of its lock with it, run.lock stays behind naming it,
    and the next run takes the lock over and says whose it was."""
    from nb_helpers.faults.run_lock import RunLocked, release_run_lock, take_run_lock

    holder = hold_run_lock(tmp_path)
    try:
        with pytest.raises(RunLocked, match=f"is being trained by process {holder.pid} "):
            take_run_lock(tmp_path)
    finally:
        holder.kill()  # SIGKILL: no atexit, no release
        holder.wait()
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == holder.pid  # left behind, as kill -9 leaves it
    take_run_lock(tmp_path)
    out = capsys.readouterr().out
    assert f"process {holder.pid} on {socket.gethostname()}" in out and "taking over its stale lock" in out
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    release_run_lock(tmp_path)
    assert not (tmp_path / "run.lock").exists()


def test_a_lock_file_naming_a_live_process_that_does_not_hold_it_does_not_block(tmp_path, capsys):
    """The OS lock decides, not the PID in the file: a dead holder's PID reused by an unrelated program (here: a
    process that never took the lock) does not keep the run locked."""
    from nb_helpers.faults.run_lock import release_run_lock, take_run_lock

    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "run.lock").write_text(json.dumps({"pid": unrelated.pid, "host": socket.gethostname()}))
        take_run_lock(tmp_path)
    finally:
        unrelated.kill()
        unrelated.wait()
    assert "taking over its stale lock" in capsys.readouterr().out
    release_run_lock(tmp_path)


def test_a_filelock_that_ignores_on_acquired_still_locks_and_says_what_it_cannot_do(tmp_path, capsys, monkeypatch):
    """filelock before 3.30 drops on_acquired without a word (a torch image's copy, under a --no-deps install):
    the run still takes the OS lock, and says once that it cannot name holders, with the fix."""
    import filelock

    from nb_helpers.faults.run_lock import release_run_lock, take_run_lock

    class OldFileLock(filelock.FileLock):
        def __init__(self, *args, on_acquired=None, **kwargs):
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(filelock, "FileLock", OldFileLock)
    take_run_lock(tmp_path)
    try:
        out = capsys.readouterr().out
        assert "predates 3.30" in out and "pip install 'filelock>=3.30'" in out
        with pytest.raises(filelock.Timeout):  # another handle, as a second process would try
            filelock.FileLock(tmp_path / "run.lock").acquire(blocking=False)
    finally:
        release_run_lock(tmp_path)
    assert not (tmp_path / "run.lock").exists()


# --- 7. SIGTERM is handled like Ctrl-C --------------------------------------------------------------------------

def test_sigterm_saves_what_ctrl_c_saves_then_exits_143(tiny_cfg, capsys):
    from nb_helpers.recovery import last_checkpoint
    from nb_helpers.training import train

    def sigterm_at_2(record):
        if record.get("step") == 2 and "loss" in record:
            os.kill(os.getpid(), signal.SIGTERM)

    def unhandled(signum, frame):
        raise AssertionError("SIGTERM reached the previous handler: training did not handle it")

    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        with pytest.raises(SystemExit) as exit_:
            train(tiny_cfg.replace(max_steps=5, save_steps=50, task_eval_samples=0), listeners=[sigterm_at_2],
                  verbose=False)
        assert signal.getsignal(signal.SIGTERM) is unhandled  # put back once training ended
    finally:
        signal.signal(signal.SIGTERM, before)
    assert exit_.value.code == 143
    run_dir = newest_run(tiny_cfg)
    assert last_checkpoint(run_dir).name == "checkpoint-2"
    assert summary_of(run_dir)["status"] == "interrupted" and summary_of(run_dir)["steps"] == 2
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists()
    assert not (run_dir / "run.lock").exists()
    out = capsys.readouterr().out
    assert "SIGTERM received" in out and f"--resume {run_dir}" in out


def test_sigterm_is_not_handled_off_the_main_thread():
    """signal.signal raises outside the main thread: training from a thread of the user's keeps the default."""
    import threading

    from nb_helpers.faults.signals import sigterm_as_interrupt

    before, errors = signal.getsignal(signal.SIGTERM), []

    def train_in_a_thread():
        try:
            with sigterm_as_interrupt():
                assert signal.getsignal(signal.SIGTERM) is before
        except Exception as e:  # noqa: BLE001 - reported to the test below
            errors.append(e)

    thread = threading.Thread(target=train_in_a_thread)
    thread.start()
    thread.join()
    assert not errors and signal.getsignal(signal.SIGTERM) is before


# --- 8. a kill before finish_run loses none of the first start's measures ----------------------------------------

def test_a_killed_run_resumes_with_its_first_measures_and_predictions(killed_run, tmp_path, capsys):
    from nb_helpers.summary import BEFORE_TRAINING_KEYS
    from nb_helpers.training import train

    run_dir = copy_run(killed_run, tmp_path)
    (run_dir / "run.lock").write_text(json.dumps({"pid": dead_pid(), "host": socket.gethostname()}))  # kill -9's

    train(RunConfig(), resume_from=run_dir, verbose=False)
    summary = summary_of(run_dir)
    assert all(summary[k] is not None for k in BEFORE_TRAINING_KEYS), summary
    predictions = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    kept = json.loads((killed_run / "before_training.json").read_text())  # written by the first start, before step 1
    assert {k: summary[k] for k in BEFORE_TRAINING_KEYS} == {k: kept[k] for k in BEFORE_TRAINING_KEYS}
    assert [p["base"] for p in predictions] == [p["prediction"] for p in kept["base_answers"]["predictions"]]
    assert "taking over its stale lock" in capsys.readouterr().out and not (run_dir / "run.lock").exists()


# --- 13. a corrupt metrics line never blocks reading -------------------------------------------------------------

def test_a_corrupt_metrics_line_is_skipped_with_its_file_and_line(tmp_path, capsys):
    from nb_helpers.metrics import read_metrics
    from nb_helpers.recovery import split_metrics_at

    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n\x00\x00garbage\n" + json.dumps({"step": 2, "loss": 1.5})
                    + "\n[1, 2]\n" + json.dumps({"step": 3, "loss": 1.0}) + "\n")
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    out = capsys.readouterr().out
    assert f"{path}:2: skipped, not a metrics record" in out and f"{path}:4: skipped" in out
    split_metrics_at(tmp_path, 2)
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    later = (tmp_path / "metrics.after-checkpoint.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in later] == [3]
    moved = (tmp_path / "metrics.unreadable.txt").read_text()
    assert moved == "metrics.jsonl:2: \x00\x00garbage\nmetrics.jsonl:4: [1, 2]\n"  # as they were, where they were
    path.write_text(path.read_text() + json.dumps({"step": 3, "loss": 0.9}) + "\n")  # a second resume's later step
    split_metrics_at(tmp_path, 2)
    assert len((tmp_path / "metrics.after-checkpoint.jsonl").read_text().splitlines()) == 2  # added, not replaced


def test_a_checkpoint_the_check_does_not_recognise_is_kept_and_training_goes_on(tmp_path, capsys):
    """Right after the Trainer saved it, a checkpoint that fails the check means the check is out of date (a new
    transformers layout), not a cut-short save: one line, the checkpoint published, training not stopped."""
    from nb_helpers.faults.checkpoints import STAGING, publish

    staged = tmp_path / "checkpoints" / STAGING / "checkpoint-3"
    staged.mkdir(parents=True)
    (staged / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    assert publish(tmp_path / "checkpoints", 3, keep=2) == tmp_path / "checkpoints" / "checkpoint-3"
    assert (tmp_path / "checkpoints" / "checkpoint-3" / "trainer_state.json").exists()
    assert "fails the completeness check right after the Trainer saved it" in capsys.readouterr().out
