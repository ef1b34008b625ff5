"""The first start's measures, kept as soon as they are taken. The base model's eval loss, its task score and its
answers used to reach disk only in summary.json, at the end: after a kill -9 a resume found none, and its summary
said null and it wrote no predictions.jsonl. before_training.json holds them from the moment they are measured."""

from __future__ import annotations

from pathlib import Path

from nb_helpers.runs import read_json, write_json
from nb_helpers.summary import BEFORE_TRAINING_KEYS

FILE = "before_training.json"


def keep_before_training(run) -> None:
    """Write the keys and the base model's answers (atomically: a kill leaves the old file or none)."""
    write_json(Path(run.run_dir) / FILE, {**{k: run.summary.get(k) for k in BEFORE_TRAINING_KEYS},
                                          "base_answers": run.base_answers})


def restore_before_training(run) -> bool:
    """A resumed run takes its first start's measures; False when they were never kept (measure them again: until
    trainer.train() loads the checkpoint, the model is still the base model)."""
    try:
        kept = read_json(Path(run.run_dir) / FILE)
    except ValueError:  # edited by hand into something else than JSON: measure again
        kept = {}
    if not isinstance(kept, dict) or not kept:
        return False
    run.summary.update({k: kept.get(k) for k in BEFORE_TRAINING_KEYS})
    run.base_answers = kept.get("base_answers")
    return True
