"""metrics.jsonl lines that are not records: the last line cut short by a kill during its write, or any line
garbled by hand or by two runs writing at once. Reading skips each with one line naming FILE:LINE; a resume moves
them to metrics.unreadable.txt (kept as they were, not lost) so that the file it appends to is clean again."""

from __future__ import annotations

import json
from pathlib import Path

from nb_helpers.frontend import say_once

UNREADABLE = "metrics.unreadable.txt"


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


def why(number: int, path: Path, line_count: int) -> str:
    if number == line_count:
        return "the last line, cut short (the run was stopped while writing it)"
    return "not a metrics record (edited by hand, or written by two runs at once)"


def note_skipped(path: Path, bad: list[tuple[int, str]]) -> None:
    count = len(path.read_text(encoding="utf-8", errors="replace").splitlines()) if bad else 0
    for number, _ in bad:
        say_once(f"metrics line {path}:{number}", f"[metrics] {path}:{number}: skipped, {why(number, path, count)}")


def set_aside(run_dir: Path, path: Path, bad: list[tuple[int, str]]) -> None:
    """Append the bad lines to metrics.unreadable.txt as they were, each after its FILE:LINE, and say so."""
    if not bad:
        return
    with open(Path(run_dir) / UNREADABLE, "a", encoding="utf-8") as f:
        f.writelines(f"{path.name}:{number}: {line}\n" for number, line in bad)
    lines = ", ".join(str(number) for number, _ in bad)
    print(f"[resume] {path.name}: line(s) {lines} were not metrics records (a write cut short); moved to {UNREADABLE}")
