"""Loading and checking instruction data, in the formats people actually have.

Accepted per JSONL row (one format per file):
  {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}   last message = the answer
  {"prompt": "...", "completion": "..."}                                           strings or message lists
  {"instruction": "...", "input": "...", "output": "..."}                          Alpaca style; input optional
  {"text": "..."}                                                                  plain text, no chat template
or a hub dataset name (needs the hub), whose rows use one of the same formats.

Everything except `text` becomes {"prompt": [messages], "completion": [assistant message]}: TRL then applies
the model's chat template and, with completion_only_loss, computes the loss on the answer tokens only.

One validator serves both `python -m nb_helpers validate-data` and training: `check_jsonl` collects every
problem as FILE:LINE: problem — fix, and never raises on bad content.
"""

from __future__ import annotations

import codecs
import errno
import os
import json
from dataclasses import dataclass, field
from pathlib import Path

from nb_helpers.config import ConfigError, RunConfig
from nb_helpers.hub import missing_path_problem

ROLES = ("system", "user", "assistant")
FIELDS = {"messages": ("messages",), "prompt_completion": ("prompt", "completion"),
          "instruction": ("instruction", "output"), "text": ("text",)}


class DataError(ValueError):
    """A dataset problem, reported as FILE:LINE: problem — fix."""


class RowProblem(ValueError):
    def __init__(self, problem: str, fix: str):
        super().__init__(problem)
        self.problem, self.fix = problem, fix


# --- one JSONL line as people's tools write it, read into JSON or refused with the line's problem and its fix -------
# A Windows editor starts the file with a UTF-8 byte order mark, which made line 1, a good row, "not valid JSON";
# CRLF line ends are JSON whitespace already. A lone surrogate ("\ud800", half of a UTF-16 pair, which json.dumps
# writes for a broken emoji) decodes to text that no tokenizer and no print can take, and thousands of nested
# brackets overflow the JSON reader's recursion: both crashed `validate-data` with a traceback; each is a row problem.

def split_lines(raw: bytes) -> list[bytes]:
    """The file's lines, numbered from 1 by the caller; a byte order mark is not part of line 1."""
    return raw.removeprefix(codecs.BOM_UTF8).split(b"\n")


# One 50 MB line took 147 s and 8 GiB of RAM to check (the whole file read at once, then the line parsed, normalised
# and tokenized). Lines are now read one at a time, and one longer than this is skipped unread in 1 MiB pieces: no
# max_length a 4 GB card runs holds a million bytes of text (about 250,000 tokens).
MAX_LINE_BYTES = 1 << 20


def read_lines(handle):
    """(line number, the line's bytes without its end, or None when it is longer than MAX_LINE_BYTES, its length)
    for each line of a binary file, reading at most MAX_LINE_BYTES + 1 bytes at a time."""
    number = 0
    while line := handle.readline(MAX_LINE_BYTES + 1):
        number += 1
        if number == 1:
            line = line.removeprefix(codecs.BOM_UTF8)
        size = len(line)
        if size > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while piece := handle.readline(MAX_LINE_BYTES):
                size += len(piece)
                if piece.endswith(b"\n"):
                    break
            yield number, None, size
            continue
        yield number, line.removesuffix(b"\n"), size


def too_long(size: int) -> RowProblem:
    return RowProblem(f"{size / 1e6:.1f} MB on one line, more than any row can train on (1 MiB at most; max_length "
                      "cuts every row to its first tokens)", "split it into rows of one example each, or remove it")


def parse_line(raw_line: bytes):
    """The line's JSON value, or RowProblem."""
    try:
        line = raw_line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RowProblem(f"not UTF-8 (byte 0x{raw_line[e.start]:02x} at column {e.start + 1})",
                         "re-save the file as UTF-8") from None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise RowProblem(f"not valid JSON ({e.msg} at column {e.colno})", "fix or remove this line") from None
    except RecursionError:
        raise RowProblem("brackets nested too deeply to read", "fix or remove this line (a row is one object of "
                         "strings and message lists)") from None
    except ValueError as e:  # an integer of over 4,300 digits: Python refuses to read it (int_max_str_digits)
        raise RowProblem(f"a number too long to read ({str(e).split(':')[0]})", "fix or remove this line (a row "
                         "holds strings, not numbers)") from None
    if "\\u" in line:  # surrogates come only from \u escapes: the UTF-8 decoder refuses encoded ones
        refuse_lone_surrogates(record)
    return record


def refuse_lone_surrogates(record) -> None:
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        half = f"\\u{ord(e.object[e.start]):04x}"
        raise RowProblem(f"holds {half}, half of a UTF-16 pair with no other half (not a character)",
                         f"write the whole character, or remove the {half} escape") from None


@dataclass
class Problem:
    line: int | None
    severity: str  # "error" or "warning"
    problem: str
    fix: str

    def format(self, source: str) -> str:
        where = f"{source}:{self.line}" if self.line is not None else source
        return f"{where}: {self.severity}: {self.problem} — {self.fix}"


@dataclass
class DataReport:
    source: str
    rows: list[dict] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)  # the line of each good row
    lengths: list[tuple[int, int]] = field(default_factory=list)  # with a tokenizer: (prompt, total) tokens of each
    problems: list[Problem] = field(default_factory=list)
    unreadable: str | None = None  # why the file could not be read at all

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "warning"]

    @property
    def exit_code(self) -> int:
        return 2 if self.unreadable else (1 if self.errors else 0)

    def add(self, line, severity, problem, fix) -> None:
        self.problems.append(Problem(line, severity, problem, fix))

    def text(self, limit: int = 50) -> str:
        if self.unreadable:
            return f"{self.source}: cannot read: {self.unreadable}"
        shown = sorted(self.problems, key=lambda p: (p.line or 0, p.severity))[:limit]
        lines = [p.format(self.source) for p in shown]
        if len(self.problems) > limit:
            lines.append(f"... and {len(self.problems) - limit} more")
        lines.append(f"{self.source}: {len(self.rows)} usable rows, {len(self.errors)} error(s), "
                     f"{len(self.warnings)} warning(s)")
        return "\n".join(lines)


def detect_format(row: dict) -> str | None:
    if "messages" in row:
        return "messages"
    if "prompt" in row or "completion" in row:
        return "prompt_completion"
    if "instruction" in row or "output" in row:
        return "instruction"
    if "text" in row:
        return "text"
    return None


def _check_text(value, what: str) -> str:
    if not isinstance(value, str):
        raise RowProblem(f"{what} is {type(value).__name__}, not a string", f"make {what} a JSON string")
    if not value.strip():
        raise RowProblem(f"{what} is empty", f"fill in {what} or remove the row")
    return value


def _check_messages(messages, what: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RowProblem(f"{what} must be a non-empty list of messages", 'use [{"role": "user", "content": "..."}, ...]')
    for i, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise RowProblem(f"message {i} of {what} needs 'role' and 'content'",
                             'write it as {"role": "user", "content": "..."}')
        if message["role"] not in ROLES:
            raise RowProblem(f"message {i} has unknown role {message['role']!r}", f"use one of {', '.join(ROLES)}")
        _check_text(message["content"], f"the content of message {i} ({message['role']})")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _check_turn_order(messages: list[dict]) -> None:
    turns = messages[1:] if messages[0]["role"] == "system" else messages
    for i, message in enumerate(turns):
        expected = "user" if i % 2 == 0 else "assistant"
        if message["role"] != expected:
            position = i + 1 + (len(messages) - len(turns))
            raise RowProblem(f"message {position} is {message['role']!r} where {expected!r} was expected",
                             "after an optional system message, turns must alternate user, assistant, user, ...")


def normalize_row(row, completion_only_loss: bool = True) -> dict:
    """One raw row -> {"prompt": [...], "completion": [...]} or {"text": ...}; raises RowProblem."""
    if not isinstance(row, dict):
        raise RowProblem(f"row is a JSON {type(row).__name__}, not an object", 'write each line as {"messages": [...]}')
    fmt = detect_format(row)
    if fmt is None:
        raise RowProblem(f"row matches no accepted format (keys: {', '.join(sorted(row)) or 'none'})",
                         "use messages, prompt/completion, instruction/input/output or text")
    if missing := [name for name in FIELDS[fmt] if name not in row]:
        raise RowProblem(f"missing field {missing[0]!r} for the {fmt.replace('_', '/')} format",
                         f"add {missing[0]!r} to the row")
    if fmt == "text":
        return {"text": _check_text(row["text"], "'text'")}
    if fmt == "messages":
        messages = _check_messages(row["messages"], "'messages'")
        _check_turn_order(messages)
        prompt, completion = messages[:-1], messages[-1:]
    elif fmt == "prompt_completion":
        prompt = (_check_messages(row["prompt"], "'prompt'") if isinstance(row["prompt"], list)
                  else [{"role": "user", "content": _check_text(row["prompt"], "'prompt'")}])
        completion = (_check_messages(row["completion"], "'completion'") if isinstance(row["completion"], list)
                      else [{"role": "assistant", "content": _check_text(row["completion"], "'completion'")}])
    else:
        instruction = _check_text(row["instruction"], "'instruction'")
        extra = row.get("input") or ""
        if not isinstance(extra, str):
            raise RowProblem(f"'input' is {type(extra).__name__}, not a string", "make 'input' a string or leave it out")
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        prompt = [{"role": "user", "content": user}]
        completion = [{"role": "assistant", "content": _check_text(row["output"], "'output'")}]
    if not prompt or completion[-1]["role"] != "assistant":
        fix = ("end each row with the assistant's answer (loss is on answers only)" if completion_only_loss
               else "end each row with the assistant's answer, or use {'text': ...} rows")
        raise RowProblem("no assistant answer after a user turn, so there is nothing to learn", fix)
    return {"prompt": prompt, "completion": completion}


def training_tokens(row: dict, tokenizer, completion_only_loss: bool = True) -> dict:
    """One normalized row as SFTTrainer sees it (TRL 1.16's prompt-completion path): the chat-templated `text`,
    its `input_ids`, and `labels` holding -100 where a token does not count in the loss. The prompt is the part
    the chat template renders for the prompt messages plus the assistant's opening; the answer is the rest."""
    if "text" in row:
        ids = tokenizer(row["text"], add_special_tokens=False)["input_ids"]
        return {"text": row["text"], "input_ids": ids, "labels": list(ids)}
    ids = lambda messages, **kw: list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                                     **kw)["input_ids"])
    prompt_ids = ids(row["prompt"], add_generation_prompt=True)
    full_ids = ids(row["prompt"] + row["completion"])
    start = next((i for i, (a, b) in enumerate(zip(prompt_ids, full_ids)) if a != b), min(len(prompt_ids), len(full_ids)))
    labels = [-100] * start + full_ids[start:] if completion_only_loss else list(full_ids)
    return {"text": tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=False),
            "input_ids": full_ids, "labels": labels}


def _token_count(tokenizer, row: dict) -> tuple[int, int]:
    """(prompt tokens, total tokens) as the trainer will see them."""
    if "text" not in row and not getattr(tokenizer, "chat_template", None):  # the model's own; we never invent one
        raise DataError("this model's tokenizer has no chat template (a base checkpoint?), so chat rows cannot be "
                        "formatted: use the model's instruct/chat variant, or {'text': ...} rows")
    tokens = training_tokens(row, tokenizer)
    prompt = 0 if "text" in row else tokens["labels"].count(-100)
    return prompt, len(tokens["input_ids"])


# --- rows against max_length, as SFTTrainer (TRL 1.16) treats them -------------------------------------------------
# A row longer than max_length loses its last tokens; one whose prompt alone fills max_length keeps no answer token to
# learn from, and SFTTrainer drops it ("fully masked"). When every row went, training crashed after the weights had
# loaded and left a half run folder that runs/latest pointed at; data loading now stops first, saying how long the
# rows are and what max_length would keep them.

def row_dropped(prompt_tokens: int, max_length: int, completion_only_loss: bool) -> bool:
    """Loss on answers only, and the answer starts at or after max_length. (Text rows count no prompt: never.)"""
    return completion_only_loss and prompt_tokens >= max_length


def length_warning(prompt_tokens: int, total: int, max_length: int, completion_only_loss: bool):
    """(problem, fix) for a row longer than max_length, else None."""
    if total <= max_length:
        return None
    if row_dropped(prompt_tokens, max_length, completion_only_loss):
        return (f"{total} tokens; the prompt alone ({prompt_tokens}) fills max_length {max_length}, so the whole "
                "answer is cut and the row is dropped", f"raise max_length to {total} or shorten the prompt")
    cut = total - max_length
    return (f"{total} tokens, {cut} over max_length {max_length}: the last {cut} tokens would be cut",
            f"raise max_length to {total} or shorten the row")


def all_dropped_problem(source: str, lengths: list[tuple[int, int]], max_length: int,
                        completion_only_loss: bool) -> str | None:
    """The message when every row (`lengths`: (prompt, total) tokens of each) would be dropped, else None."""
    if not lengths or not all(row_dropped(prompt, max_length, completion_only_loss) for prompt, _ in lengths):
        return None
    longest = max(total for _, total in lengths)
    return (f"{source}: all {len(lengths)} rows would be dropped: each prompt alone fills max_length {max_length} "
            f"(the longest row has {longest} tokens), so no answer token is left to learn from. Raise max_length to "
            f"{longest} (it must stay within the model's positions), or shorten the prompts")


def check_jsonl(path: str | Path, completion_only_loss: bool = True, tokenizer=None,
                max_length: int | None = None) -> DataReport:
    """Check every line of a JSONL dataset. Never raises for bad content: problems go into the report."""
    if not isinstance(path, (str, Path)):
        raise DataError(f"check_jsonl({path!r}): give the path of a JSONL file (a str or pathlib.Path), not a "
                        f"{type(path).__name__}")
    path = Path(path)
    report = DataReport(str(path))
    try:
        with open(path, "rb") as handle:
            check_lines(read_lines(handle), report, completion_only_loss, tokenizer, max_length)
    except (FileNotFoundError, IsADirectoryError, PermissionError, OSError) as e:
        report.unreadable = f"{type(e).__name__}: {e.strerror or e} — check the path (train_file/eval_file)"
        return report
    if not report.rows and not report.errors:
        report.add(None, "error", "no rows (the file is empty)", "add at least one JSON line")
    return report


def check_lines(lines, report: DataReport, completion_only_loss: bool, tokenizer, max_length: int | None) -> None:
    """check_jsonl's work on (number, line, size) tuples: each problem into `report`, each usable row too."""
    seen: dict[str, int] = {}
    first_kind: tuple[str, int] | None = None
    for number, raw_line, size in lines:
        if raw_line is not None and not raw_line.strip():
            continue
        try:
            if raw_line is None:
                raise too_long(size)
            row = normalize_row(parse_line(raw_line), completion_only_loss)
        except RowProblem as p:
            report.add(number, "error", p.problem, p.fix)
            continue
        kind = "text" if "text" in row else "chat"
        if first_kind is None:
            first_kind = (kind, number)
        elif kind != first_kind[0]:
            report.add(number, "error", f"a {kind} row in a file whose first row (line {first_kind[1]}) is {first_kind[0]}",
                       "use one format per file (text rows get no chat template and no answer-only loss)")
            continue
        key = json.dumps(row, sort_keys=True)
        if key in seen:
            report.add(number, "warning", f"duplicate of line {seen[key]}",
                       "remove it unless you mean to weight this example twice")
        else:
            seen[key] = number
        if tokenizer is not None and max_length:
            report.lengths.append(_token_count(tokenizer, row))
            warning = length_warning(*report.lengths[-1], max_length, completion_only_loss)
            if warning:
                report.add(number, "warning", *warning)
        report.rows.append(row)
        report.lines.append(number)


def longest_row_tokens(rows: list[dict], tokenizer) -> int:
    """Tokens in the longest row as the trainer sees it (chat template applied). Batches are padded to their
    longest row, so this, not max_length, is the longest sequence training will ever run."""
    return max(_token_count(tokenizer, row)[1] for row in rows)


def load_rows(source: str, cfg: RunConfig, limit: int | None = None, tokenizer=None) -> list[dict]:
    """Rows of a JSONL file (checked) or a hub dataset, the first `limit` of them (None or 0: all). Errors stop here,
    before any model loads, unless cfg.skip_invalid drops the bad rows (their line numbers are printed)."""
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise ConfigError(f"load_rows(limit={limit!r}): give a whole number of rows, 0 or more, or None for all")
    if not isinstance(source, (str, Path)) or not isinstance(cfg, RunConfig):
        raise ConfigError(f"load_rows({source!r}, {type(cfg).__name__}): give a file path or Hub dataset name (str) "
                          "and a RunConfig, e.g. load_rows('data/eval.jsonl', default_config())")
    source = str(source)
    path = cfg.resolve_path(source)
    if path.is_symlink() and not path.exists():  # a loop, or a target that is gone: never a Hub name nor a typo
        raise DataError(f"{source}: a symbolic link that leads to no file ({link_problem(path)}); point it at the "
                        "JSONL file, or give the file's own path")
    if path.suffix in {".jsonl", ".json"} or path.exists():
        report = check_jsonl(path, cfg.completion_only_loss, tokenizer, cfg.max_length)
        if report.unreadable:
            raise DataError(report.text())
        if report.errors and not cfg.skip_invalid:
            raise DataError(report.text(limit=20) + "\nFix these rows, check them with "
                            f"`python -m nb_helpers validate-data {source}`, or set skip_invalid=True to drop them.")
        if report.errors:
            dropped = [p.line for p in report.errors if p.line is not None]
            print(f"[data] {source}: skipped {len(dropped)} invalid row(s) (skip_invalid=True), lines "
                  f"{', '.join(map(str, dropped[:30]))}{' ...' if len(dropped) > 30 else ''}")
        if not report.rows:
            raise DataError(report.text(limit=20))
        nothing_left = all_dropped_problem(source, report.lengths[: limit or None], cfg.max_length,
                                           cfg.completion_only_loss)
        if nothing_left:
            raise DataError(nothing_left)
        for problem in report.warnings[:5]:
            print(f"[data] {problem.format(source)}")
        if len(report.warnings) > 5:
            print(f"[data] ... {len(report.warnings) - 5} more warning(s): `python -m nb_helpers validate-data {source}`")
        rows = report.rows
    else:
        rows = hub_rows(source, cfg)
    return rows[:limit] if limit else rows


def link_problem(path: Path) -> str:
    try:
        path.resolve(strict=True)
    except RuntimeError:  # Python 3.11 reports a loop so
        return "it loops back on itself"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "it loops back on itself"
    return f"it points at {os.readlink(path)}, which does not exist"


def hub_rows(source: str, cfg: RunConfig) -> list[dict]:
    """A Hub dataset's rows ("name" or "name:split"). A name that looks like a local path never goes to the Hub, and
    a Hub that cannot give it (offline, no such dataset or split) is one line, not a traceback."""
    from nb_helpers.hub import offline, offline_reason

    knob = next((k for k in ("train_file", "eval_file") if getattr(cfg, k) == source), "file")
    missing = missing_path_problem(knob, source, cfg.resolve_path, "file")
    if missing:
        raise DataError(missing)
    from datasets import load_dataset

    name, _, split = source.partition(":")
    try:
        dataset = load_dataset(name, split=split or "train")
    except (OSError, ValueError) as e:  # offline, not on the Hub, no such split
        why = f"the Hub is offline ({offline_reason()})" if offline() else str(e).strip().splitlines()[0][:300]
        raise DataError(f"{knob}={source!r}: no local file {cfg.resolve_path(source)}, and no Hub dataset either: "
                        f"{why}. Give the path of a JSONL file (relative to the project root, or absolute)") from None
    rows = []
    for number, record in enumerate(dataset, start=1):
        try:
            rows.append(normalize_row(dict(record), cfg.completion_only_loss))
        except RowProblem as p:
            if not cfg.skip_invalid:
                raise DataError(f"{source}:{number}: error: {p.problem} — {p.fix}") from None
    return rows


def to_dataset(rows: list[dict]):
    from datasets import Dataset

    return Dataset.from_list(rows)


def load_train_eval(cfg: RunConfig, tokenizer=None):
    """Read and check both splits before the model's weights load, so data problems cost seconds, not minutes."""
    train_rows = load_rows(cfg.train_file, cfg, cfg.max_train_samples, tokenizer)
    eval_rows = load_rows(cfg.eval_file, cfg, cfg.max_eval_samples, tokenizer) if cfg.eval_file else []
    if "text" in train_rows[0] and cfg.completion_only_loss:
        print("[data] plain-text rows have no separate answer: training on all tokens (completion_only_loss ignored)")
    return train_rows, eval_rows


def load_task_rows(cfg: RunConfig, tokenizer=None) -> list[dict]:
    """The held-out prompts the task metric scores: the first task_eval_samples rows of the eval file, however many
    rows the eval loss reads (max_eval_samples)."""
    if not (cfg.eval_file and cfg.task_eval_samples):
        return []
    return load_rows(cfg.eval_file, cfg, cfg.task_eval_samples, tokenizer)


def prompt_messages(row: dict) -> list[dict]:
    return row["prompt"]


def answer_text(row: dict) -> str:
    return row["completion"][-1]["content"]
