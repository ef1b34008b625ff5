"""Checkpoints that count only once complete. A kill -9 or a second Ctrl-C during a save, or a full disk, used to
leave the newest checkpoints/checkpoint-N empty or partial, and `--resume` took it and crashed ("Can't find a valid
checkpoint") though the one before was intact.

While trainer.train() runs (training.guard_training), the Trainer writes each checkpoint into checkpoints/saving/
(its own output_dir, a public argument, pointed there), and PublishCheckpoints moves it to checkpoints/checkpoint-N
once its files are all there, then keeps the newest save_total_limit. A resume takes the newest complete one, says
which it skipped and why, and moves the incomplete ones to checkpoints/incomplete/ (kept, never read again).
Completeness is read from the files the Trainer writes (transformers 5), each read whole as a resume reads it:
trainer_state.json at the folder's step, the adapter as safetensors (every tensor loaded: the header's sizes against
the file), and optimizer, scheduler and RNG state, each a torch zip archive whose every record is read and checked
against its CRC (zipfile, no unpickling). Reading only the zip directory let 4 KiB of garbage inside optimizer.pt pass,
and every resume then failed after the weights loaded ("PytorchStreamReader failed reading file data/416"); now that
checkpoint is skipped, named with the damaged record, and the resume continues from the one before.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from contextlib import contextmanager
from pathlib import Path

from transformers import TrainerCallback

from nb_helpers import compat, distributed
from nb_helpers.config import ConfigError
from nb_helpers.frontend import say_once

STAGING, SET_ASIDE = "saving", "incomplete"  # beside checkpoint-N; neither matches the Trainer's `checkpoint-*`
PREFIX = "checkpoint-"
TORCH_ARCHIVES = ("optimizer.pt", "scheduler.pt")


def checkpoint_problem(folder: Path) -> str | None:
    """None when `folder` holds a whole checkpoint, else what is missing or broken, in a few words."""
    step = int(folder.name[len(PREFIX):])
    try:
        state = json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "trainer_state.json is missing or cut short"
    if not isinstance(state, dict) or state.get("global_step") != step:
        return f"trainer_state.json is at step {state.get('global_step') if isinstance(state, dict) else None}, not {step}"
    if problem := safetensors_problem(folder / "adapter_model.safetensors"):
        return problem
    rng = sorted(folder.glob("rng_state*.pth"))
    for name in (*TORCH_ARCHIVES, *(p.name for p in rng)):
        if problem := archive_problem(folder / name):
            return problem
    return None if rng else "rng_state.pth is missing"


def safetensors_problem(path: Path) -> str | None:
    """Every tensor of a safetensors file loaded (a few MB for an adapter): safetensors checks the header and each
    tensor's bytes against the file's size. Tensors carry no checksum, so bytes changed inside one go unseen."""
    from safetensors.torch import load_file

    try:
        load_file(path)
    except FileNotFoundError:
        return f"{path.name} is missing"
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a cut-short or damaged file
        return f"{path.name} is cut short or damaged ({str(e).splitlines()[0][:120]})"
    return None


def archive_problem(path: Path) -> str | None:
    """A torch.save file read as the zip archive it is: every record read in full and checked against the CRC the
    writer stored (zipfile's testzip reads 1 MiB at a time; nothing is unpickled)."""
    if not path.is_file():
        return f"{path.name} is missing"
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:  # no directory (cut short), a bad record header
        return f"{path.name} is cut short or damaged ({str(e)[:120] or type(e).__name__})"
    return f"{path.name} is damaged: its record {bad} fails its CRC check" if bad else None


def checkpoint_folders(folder: Path) -> list[Path]:
    """checkpoint-N folders, newest step first."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)


def newest_complete(folder: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint, and the newer ones skipped with why."""
    skipped = []
    for candidate in checkpoint_folders(folder):
        problem = checkpoint_problem(candidate)
        if problem is None:
            return candidate, skipped
        skipped.append((candidate, problem))
    return None, skipped


def checkpoint_to_resume(run_dir: Path, set_aside: bool = True) -> Path:
    """The checkpoint a resume continues from: the newest complete one. The incomplete ones after it are named with
    why and (by the one process that writes the run folder) moved to checkpoints/incomplete/, where neither resume
    nor the Trainer's clean-up of old checkpoints reads them."""
    folder = Path(run_dir) / "checkpoints"
    found, skipped = newest_complete(folder)
    for path, problem in skipped:
        note = f"moved to {folder.name}/{SET_ASIDE}/ (delete it to free the space)" if set_aside else "left in place"
        print(f"[resume] skipping {path.name}: {problem}; {note}")
        if set_aside:
            target = folder / SET_ASIDE / path.name
            shutil.rmtree(target, ignore_errors=True)
            target.parent.mkdir(exist_ok=True)
            path.rename(target)
    if found is None:
        raise ConfigError(f"{run_dir} has no checkpoint to resume from ({folder} holds no complete one); start a new "
                          "run instead")
    return found


def publish(folder: Path, step: int, keep: int | None) -> Path:
    """Move the staged checkpoint-`step` to checkpoints/ once it is whole; drop the oldest beyond `keep`."""
    from transformers.trainer_utils import rotate_checkpoints

    distributed.wait()  # every process has written its share (each its own RNG state)
    staged, final = folder / STAGING / f"{PREFIX}{step}", folder / f"{PREFIX}{step}"
    if distributed.is_main():
        source = staged if staged.is_dir() else final  # a Trainer that ignored our output_dir wrote it in place
        problem = checkpoint_problem(source)
        if problem:  # the Trainer finished this save: the check, not the checkpoint, is out of date. Train on
            say_once("checkpoint layout", f"[checkpoint] {source.name} fails the completeness check right after the Trainer saved it "
                     f"({problem}): transformers may have changed what a checkpoint holds; kept, but a resume will "
                     "skip it (nb_helpers/faults/checkpoints.py)")
        if source == staged:
            replace_folder(staged, final)
        rotate_checkpoints(output_dir=str(folder), save_total_limit=keep)
    distributed.wait()
    return final


def replace_folder(source: Path, target: Path) -> None:
    """Rename `source` to `target`, replacing it (a Ctrl-C checkpoint at the step a periodic one just saved)."""
    old = source.parent / f"replaced-{target.name}"
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
    source.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def discard_staged(folder: Path) -> None:
    """A save that failed leaves nothing: its partial checkpoint is deleted (the complete ones are untouched)."""
    shutil.rmtree(Path(folder) / STAGING, ignore_errors=True)


class PublishCheckpoints(TrainerCallback):
    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def on_save(self, args, state, control, **kwargs):
        publish(self.folder, state.global_step, args.save_total_limit)


@contextmanager
def staged_checkpoints(trainer, run_dir: Path):
    """While training runs: every checkpoint is written into checkpoints/saving/ and published whole."""
    folder = Path(run_dir) / "checkpoints"
    final, callback = trainer.args.output_dir, PublishCheckpoints(folder)
    if distributed.is_main():
        discard_staged(folder)  # a save a kill cut short
    trainer.args.output_dir = str(folder / STAGING)
    trainer.add_callback(callback)
    try:
        yield
    except BaseException:
        finish_staging(trainer, callback, final, folder)
        raise
    distributed.wait()  # every process is done with checkpoints/saving (its Trainer scans it) before rank 0 removes it
    finish_staging(trainer, callback, final, folder)


def finish_staging(trainer, callback, final: str, folder: Path) -> None:
    trainer.remove_callback(callback)
    trainer.args.output_dir = final
    if distributed.is_main():
        discard_staged(folder)


def save_checkpoint_now(trainer, run_dir: Path) -> Path:
    """A checkpoint at the last finished step (Ctrl-C, SIGTERM), staged and published like the periodic ones."""
    compat.save_checkpoint(trainer)
    return publish(Path(run_dir) / "checkpoints", trainer.state.global_step, trainer.args.save_total_limit)
