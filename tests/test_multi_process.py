"""Several processes (issue 12): the batch arithmetic and messages as fast unit tests, and a real
`accelerate launch` of two processes on the CPU (gloo) with the tiny model: one run folder, written by rank 0 alone,
with the global batch kept; then a resume on two processes."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from nb_helpers import distributed
from nb_helpers.config import ConfigError, RunConfig
from nb_helpers.runs import list_runs
from nb_helpers.distributed import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


# --- the batch over several processes -----------------------------------------------------------------------------

@pytest.mark.parametrize("micro, accum, world, expected", [
    (1, 8, 1, (1, 8)),   # one process: nothing changes
    (1, 8, 2, (1, 4)),   # the reference recipe on 2 GPUs: accumulation halves
    (8, 2, 2, (8, 1)),   # the bench's 16 sequences: 8 x 2 on one GPU, 8 x 1 on each of two
    (2, 2, 2, (2, 1)),
    (1, 8, 8, (1, 1)),
    (8, 1, 2, (4, 1)),   # accumulation is already 1: the micro-batch takes the split (never more memory)
    (8, 3, 2, (6, 2)),   # 12 per process: the largest micro-batch <= 8 that divides it
])
def test_per_process_batch_keeps_the_global_batch(micro, accum, world, expected):
    new_micro, new_accum = distributed.per_process_batch(micro, accum, world)
    assert (new_micro, new_accum) == expected
    assert new_micro * new_accum * world == micro * accum  # the global batch
    assert new_micro <= micro  # no process needs more activation memory than one process did


@pytest.mark.parametrize("micro, accum, world", [(1, 8, 2), (8, 2, 2), (2, 3, 3), (4, 4, 8)])
def test_config_json_keeps_the_one_process_equivalent(micro, accum, world):
    """What config.json keeps, split again at the same world size, gives back what each process ran."""
    per = distributed.per_process_batch(micro, accum, world)
    saved = distributed.one_process_equivalent(*per, world)
    assert saved[0] * saved[1] == micro * accum
    assert distributed.per_process_batch(*saved, world) == per


def test_a_batch_that_cannot_be_split_names_the_fix():
    with pytest.raises(ValueError) as e:
        distributed.per_process_batch(3, 3, 2)
    message = str(e.value)
    assert "global batch 9" in message and "2 processes" in message
    assert "grad_accum=4" in message  # the nearest accumulation that splits: 3 x 4 = 12 = 2 x 6


def test_split_line_says_what_changed():
    line = distributed.describe_split(1, 8, 2)
    assert line.startswith("[multi] 2 processes:")
    assert "grad_accum 8 -> 4 per process" in line and "global batch 8 = 1 x 4 x 2 kept" in line
    assert "micro_batch_size 8 -> 4" in distributed.describe_split(8, 1, 2)


def test_split_over_processes_raises_a_config_error(capsys):
    from nb_helpers.distributed import split_over_processes

    cfg = RunConfig(micro_batch_size=1, grad_accum=8)
    assert split_over_processes(cfg, 1) is cfg
    split = split_over_processes(cfg, 4)
    assert (split.micro_batch_size, split.grad_accum) == (1, 2)
    assert "grad_accum 8 -> 2 per process" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="cannot be split evenly over 3 processes"):
        split_over_processes(cfg, 3)


def test_resume_note_at_the_same_and_at_another_world_size(tmp_path):
    from nb_helpers.distributed import checkpoint_world_size, resume_note

    one, two = tmp_path / "checkpoint-2", tmp_path / "two" / "checkpoint-2"
    one.mkdir()
    (one / "rng_state.pth").touch()
    two.mkdir(parents=True)
    for rank in (0, 1):
        (two / f"rng_state_{rank}.pth").touch()
    assert (checkpoint_world_size(one), checkpoint_world_size(two)) == (1, 2)
    assert "resuming on 2 processes, as the checkpoint was trained" in resume_note(two, 2)
    note = resume_note(one, 2)
    assert "trained on 1 process and resumes on 2" in note
    assert "global batch stays" in note and "data order" in note


def test_ddp_settings_only_with_several_processes(tmp_path, no_gpu):
    from nb_helpers.training import TrainingRun
    from nb_helpers.trainer_setup import sft_config

    run = TrainingRun(RunConfig(), run_dir=tmp_path)
    args = sft_config(run)
    assert args.ddp_find_unused_parameters is None and args.ddp_broadcast_buffers is None
    run.world_size = 2
    args = sft_config(run)
    # every LoRA parameter gets a gradient; searching for unused ones breaks with gradient checkpointing
    assert args.ddp_find_unused_parameters is False
    assert args.ddp_broadcast_buffers is False  # computed by each process, never learned
    assert args.gradient_checkpointing_kwargs["use_reentrant"] is False


def test_each_process_loads_onto_its_own_device(monkeypatch, no_gpu):
    import torch

    from nb_helpers.models import device_map_for_this_process

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert device_map_for_this_process() == "auto"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    expected = 1 if torch.cuda.is_available() else "cpu"
    assert device_map_for_this_process() == {"": expected}


def test_more_processes_than_gpus_are_refused_before_anything_loads(monkeypatch):
    """Two processes on a machine with one GPU: NCCL stopped them at the first barrier, after the model had loaded
    ("Duplicate GPU detected", seen when the suite ran on a one-GPU machine). Now distributed.init, the first thing
    a run does, raises a settings error naming both fixes (the command line prints it without a traceback)."""
    import torch

    with pytest.raises(ConfigError) as e:
        distributed.check_one_gpu_each(2, 1)
    assert "2 processes need 2 GPUs" in str(e.value) and "shows 1" in str(e.value)
    assert "--num_processes 1" in str(e.value) and "CUDA_VISIBLE_DEVICES=" in str(e.value)
    distributed.check_one_gpu_each(2, 2)  # one each: nothing to say
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="2 processes need 2 GPUs"):
        distributed.init()


def test_one_process_needs_no_process_group(monkeypatch, capsys):
    import torch.distributed as dist

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    distributed.init()
    assert distributed.broadcast({"a": 1}) == {"a": 1}
    assert distributed.gather(3) == [3]
    distributed.wait()
    with distributed.main_first():
        pass
    assert not dist.is_initialized()
    monkeypatch.setenv("RANK", "1")
    with distributed.quiet_unless_main():
        print("from rank 1")
    assert "from rank 1" not in capsys.readouterr().out


def test_metrics_of_other_ranks_are_kept_but_not_written(tmp_path):
    from nb_helpers.metrics import MetricsCallback

    def feed(callback):
        state = SimpleNamespace(global_step=0, epoch=0.0, num_input_tokens_seen=0)
        control = SimpleNamespace(should_training_stop=False)
        callback.on_train_begin(None, state, control)
        state.global_step, state.epoch, state.num_input_tokens_seen = 1, 0.25, 400
        callback.on_step_end(None, state, control)
        callback.on_log(None, state, control, logs={"loss": 2.5, "grad_norm": 0.5, "learning_rate": 1e-3,
                                                   "num_tokens": 400.0})
        callback.close()

    fields = {"world_size": 2, "global_batch": 4}
    quiet = MetricsCallback(tmp_path / "rank1" / "metrics.jsonl", write=False, fields=fields)
    feed(quiet)
    assert not (tmp_path / "rank1").exists()
    assert quiet.records[0]["loss"] == 2.5 and quiet.records[0]["world_size"] == 2
    writer = MetricsCallback(tmp_path / "rank0" / "metrics.jsonl", fields=fields)
    feed(writer)
    lines = (tmp_path / "rank0" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == writer.records
    assert writer.records[0]["global_batch"] == 4 and writer.records[0]["tokens"] == 400


# --- a real launch: two processes on the CPU ----------------------------------------------------------------------

def launch(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`accelerate launch --multi_gpu --num_processes 2 -m nb_helpers ...`: the processes train on the CPU and talk
    through gloo, the same code path as NCCL on GPUs. The GPUs are hidden from them: on a learner's machine with one
    GPU, two processes would share it (which init refuses: tests/test_multi_process.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("NB_CI", "NB_CONFIG", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    # the project first, then whatever the caller's PYTHONPATH holds (packages installed there, as on the lent device)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.update(PYTHONPATH=path, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), "-m", "nb_helpers", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def launched(tiny_model_dir, tmp_path_factory, make_tiny_config):
    """Three steps on two processes: global batch 4 = micro 2 x accum 2 in config.json, 2 x 1 on each process.
    No LoRA dropout: each process draws its own masks, which would part the losses from one process's."""
    work = tmp_path_factory.mktemp("multi")
    cfg = make_tiny_config(tiny_model_dir, work / "runs").replace(micro_batch_size=2, grad_accum=2, lora_dropout=0.0)
    cfg.save(work / "config.json")
    proc = launch(["train", "--config", str(work / "config.json")], cwd=work)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return work, proc


@pytest.mark.slow
def test_two_processes_follow_one_process_step_for_step(launched, tiny_model_dir, no_gpu):
    """The same config in one process (2 x 2) and in two (2 x 1 each) sees the same rows in each optimizer step,
    so the losses agree to rounding. Both on the CPU: the launched processes have the GPUs hidden, and a GPU's
    kernels round otherwise (on an H200 the first losses parted by 1.1e-5)."""
    from nb_helpers.metrics import read_metrics
    from nb_helpers.training import train

    work, _ = launched
    cfg = RunConfig.load(work / "config.json").replace(runs_dir=str(work / "one-process"))
    one = [r["loss"] for r in read_metrics(train(cfg, verbose=False) / "metrics.jsonl") if "loss" in r]
    run = next(p for p in list_runs(work / "runs") if p.name != "broken")
    two = [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert len(one) == len(two) == 3
    assert two[0] == pytest.approx(one[0], rel=1e-6)  # before any update: the same 4 rows, the same loss
    # After an update they part a little: five runs of this config (1 and 2 processes) spread up to 4e-4 at step 2
    # on this CPU, one process against itself included, so the steps after the first are held only to 2e-3.
    assert two[1:] == pytest.approx(one[1:], rel=2e-3)


@pytest.mark.slow
def test_two_processes_train_one_run_written_by_rank_0(launched):
    work, proc = launched
    runs = work / "runs"
    folders = [p for p in list_runs(runs) if p.name != "broken"]  # beside base-answers/
    assert len(folders) == 1, sorted(p.name for p in runs.iterdir())  # rank 0 named it; rank 1 was told
    run = folders[0]
    assert (runs / "latest").resolve() == run.resolve()

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]  # one line per step: rank 1 wrote none
    assert len({json.dumps(r) for r in records}) == len(records)
    assert all(r["world_size"] == 2 and r["global_batch"] == 4 for r in steps)
    # 16 rows, 4 per optimizer step: each step is a quarter epoch only if each process ran 2 x 1, not 2 x 2
    assert [r["epoch"] for r in steps] == pytest.approx([0.25, 0.5, 0.75])
    assert all(r["loss"] == r["loss"] and abs(r["loss"]) < 1e3 for r in steps)  # finite

    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert summary["world_size"] == 2 and summary["global_batch"] == 4
    assert summary["per_process_batch"] == [2, 1]
    assert len(summary["peak_vram_gib_per_process"]) == 2
    config = json.loads((run / "config.json").read_text())
    assert (config["micro_batch_size"], config["grad_accum"]) == (2, 2)  # one-process equivalent, same global batch

    # Rank 0 wrote everything; the only per-process files are the Trainer's RNG states, one per rank, for a resume
    files = {p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()}
    assert {"config.json", "metrics.jsonl", "summary.json", "training.png", "predictions.jsonl",
            "adapter/adapter_model.safetensors"} <= files
    assert not any("after-checkpoint" in f or f.endswith(".tmp") for f in files)
    rng = sorted(f.rsplit("/", 1)[1] for f in files if f.startswith("checkpoints/checkpoint-2/rng_state"))
    assert rng == ["rng_state_0.pth", "rng_state_1.pth"]

    assert proc.stdout.count("[summary]") == 1  # rank 1 printed nothing
    assert "[multi] 2 processes: grad_accum 2 -> 1 per process; global batch 4 = 2 x 1 x 2 kept" in proc.stdout


@pytest.mark.slow
def test_resume_on_two_processes(launched):
    """Resume a two-process run from its checkpoint at step 2 on two processes: it says so, trains step 3 once."""
    work, _ = launched
    run = next(p for p in list_runs(work / "runs") if p.name != "broken")
    broken = work / "runs" / "broken"
    shutil.copytree(run, broken)
    shutil.rmtree(broken / "checkpoints" / "checkpoint-3")  # as if it had stopped after step 2's checkpoint
    summary = json.loads((broken / "summary.json").read_text())
    (broken / "summary.json").write_text(json.dumps({**summary, "status": "interrupted"}))  # as an interrupt leaves it
    proc = launch(["train", "--resume", str(broken)], cwd=work)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "[run] resuming on 2 processes, as the checkpoint was trained" in proc.stdout
    records = [json.loads(line) for line in (broken / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    summary = json.loads((broken / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2


def test_nvml_measures_the_gpu_this_process_trains_on(monkeypatch):
    """Each process measures its own GPU: CUDA numbers the visible GPUs, NVML all of them."""
    from nb_helpers.plan.memory import _nvml_handle

    fake = SimpleNamespace(nvmlDeviceGetHandleByIndex=lambda i: ("index", i),
                           nvmlDeviceGetHandleByUUID=lambda u: ("uuid", u))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _nvml_handle(fake, 1) == ("index", 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert _nvml_handle(fake, 1) == ("index", 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")
    assert _nvml_handle(fake, 0) == ("uuid", "GPU-aaaa")


def test_one_process_that_sees_several_gpus_trains_on_one(capsys, monkeypatch):
    """Without `accelerate launch`, the Trainer would spread the model over every GPU with nn.DataParallel, which
    SFTTrainer refuses; the config is set to one GPU before the trainer is built."""
    from nb_helpers import distributed

    class Args:
        per_device_train_batch_size, _n_gpu = 8, 2

        @property
        def n_gpu(self):
            return self._n_gpu

        @property
        def train_batch_size(self):  # as TrainingArguments computes it
            return self.per_device_train_batch_size * max(1, self.n_gpu)

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = Args()
    assert distributed.one_gpu_per_process(args)
    assert (args.n_gpu, args.train_batch_size) == (1, 8)
    assert "trains on cuda:0" in capsys.readouterr().out
    assert not distributed.one_gpu_per_process(args)  # one GPU: nothing to change
    monkeypatch.setenv("WORLD_SIZE", "2")
    args._n_gpu = 2
    assert not distributed.one_gpu_per_process(args)  # launched: each process has its own GPU already


def test_nccl_is_kept_small_unless_the_user_chose(monkeypatch):
    from nb_helpers import distributed

    monkeypatch.delenv("NCCL_MAX_NCHANNELS", raising=False)
    assert distributed.lean_nccl() == {"NCCL_MAX_NCHANNELS": "2"}
    assert os.environ["NCCL_MAX_NCHANNELS"] == "2"
    monkeypatch.setenv("NCCL_MAX_NCHANNELS", "16")
    assert distributed.lean_nccl() == {}
    assert os.environ["NCCL_MAX_NCHANNELS"] == "16"
