"""Per-step metrics: one JSON line per optimizer step, flushed as it is written, so a crash loses nothing.
Each line carries the step's memory as nb_helpers.plan.memory measures it (PyTorch's allocator and NVML's device used).

Lines that are not records (the last line cut short by a kill during its write, or any line garbled by hand or by two
runs writing at once) never block reading: reading skips each with one line naming FILE:LINE, and a resume moves them
to metrics.unreadable.txt (kept as they were, not lost) so that the file it appends to is clean again.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

from transformers import TrainerCallback

from nb_helpers.frontend import say_once
from nb_helpers.plan.memory import memory_snapshot

UNREADABLE = "metrics.unreadable.txt"


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class MetricsCallback(TrainerCallback):
    """Writes metrics.jsonl: step, epoch, loss, lr, grad_norm, tokens, step_s, tokens_per_s, memory, plus `fields`
    (world_size, global_batch) on every training line. With several processes every one keeps its records (for the
    NaN stop, which all must agree on, and its own peak memory), and only the one with `write=True` writes the file."""

    def __init__(self, path: str | Path, listeners=(), write: bool = True, fields: dict | None = None):
        self.path = Path(path)
        self.listeners = list(listeners)  # called with each record (live plots)
        self.write, self.fields = write, dict(fields or {})
        self._step_start, self._pending = None, {}
        self._counted, self._logged_step = None, 0  # TRL's running token count and the step at the last line
        self.records: list[dict] = []
        self.non_finite_step: int | None = None

    def _write(self, record: dict) -> None:
        if self.write and getattr(self, "_file", None) is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        if self.write:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()  # flushed per line: an interrupted run keeps every finished step
        self.records.append(record)
        for listener in self.listeners:
            listener(record)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.write:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch()  # the run folder always has its metrics file, even when step 1 never finishes
        self._logged_step = state.global_step
        _sync()
        self._step_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        # Wall time of the whole optimizer step: data loading, every micro-batch, the optimizer and logging.
        # Measured from the previous step's end (the Trainer fetches a step's micro-batches before
        # on_step_begin, so that hook would miss them); evaluation and checkpoint saves are excluded below.
        _sync()
        now = time.perf_counter()
        step_s = now - self._step_start if self._step_start else None
        self._step_start = now
        self._pending = {"step": state.global_step, "epoch": state.epoch, "step_s": step_s, **memory_snapshot()}

    def _tokens_per_step(self, state, logs: dict) -> float | None:
        """Tokens a step trained since the last line, by SFTTrainer's running count (its `num_tokens` metric: every
        process's non-padding tokens), which a new trainer starts again at 0."""
        total, before = logs.get("num_tokens"), self._counted or 0
        if total is None:
            return None
        self._counted, steps, self._logged_step = total, state.global_step - self._logged_step, state.global_step
        return (total - (before if total >= before else 0)) / max(1, steps)

    def _restart_clock(self, *args, **kwargs):
        _sync()
        self._step_start = time.perf_counter()

    on_evaluate = on_save = _restart_clock  # eval and checkpoint time are not training time

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "eval_loss" in logs:
            self._write({"step": state.global_step, "epoch": round(state.epoch or 0.0, 4), "eval_loss": logs["eval_loss"]})
            return
        if "loss" not in logs or not self._pending or self._pending["step"] != state.global_step:
            return
        tokens, step_s = self._tokens_per_step(state, logs), self._pending["step_s"]  # tokens: a mean per step
        record = {"step": state.global_step, "epoch": round(state.epoch or 0.0, 4), "loss": logs["loss"],
                  "lr": logs.get("learning_rate"), "grad_norm": logs.get("grad_norm"),
                  "tokens": None if tokens is None else round(tokens), "step_s": step_s,
                  "tokens_per_s": tokens / step_s if step_s and tokens else None,
                  **{k: v for k, v in self._pending.items() if k not in ("step", "epoch", "step_s")}, **self.fields}
        self._write(record)
        if not all(math.isfinite(v) for v in (record["loss"], record["grad_norm"] or 0.0)):
            self.non_finite_step = state.global_step
            control.should_training_stop = True

    def close(self) -> None:
        if getattr(self, "_file", None) is not None:
            self._file.close()
            self._file = None


def parse_metrics(path: Path) -> tuple[list[dict], list[tuple[int, str]]]:
    """The records of a metrics.jsonl, and the (line number, text) of each line that is not one."""
    if not path.exists():
        return [], []
    records, bad = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        else:
            bad.append((number, line))
    return records, bad


def unreadable_reason(number: int, path: Path, line_count: int) -> str:
    if number == line_count:
        return "the last line, cut short (the run was stopped while writing it)"
    return "not a metrics record (edited by hand, or written by two runs at once)"


def note_skipped(path: Path, bad: list[tuple[int, str]]) -> None:
    count = len(path.read_text(encoding="utf-8", errors="replace").splitlines()) if bad else 0
    for number, _ in bad:
        say_once(f"metrics line {path}:{number}",
                 f"[metrics] {path}:{number}: skipped, {unreadable_reason(number, path, count)}")


def set_aside(run_dir: Path, path: Path, bad: list[tuple[int, str]]) -> None:
    """Append the bad lines to metrics.unreadable.txt as they were, each after its FILE:LINE, and say so."""
    if not bad:
        return
    with open(Path(run_dir) / UNREADABLE, "a", encoding="utf-8") as f:
        f.writelines(f"{path.name}:{number}: {line}\n" for number, line in bad)
    lines = ", ".join(str(number) for number, _ in bad)
    print(f"[resume] {path.name}: line(s) {lines} were not metrics records (a write cut short); moved to {UNREADABLE}")


def read_metrics(path: str | Path) -> list[dict]:
    """Read metrics.jsonl; a line that is not a record (the last one, cut short by a kill) is skipped with a note."""
    records, bad = parse_metrics(Path(path))
    note_skipped(Path(path), bad)
    return records


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None
