"""One JSONL line as people's tools write it, read into JSON or refused with the line's problem and its fix.

A Windows editor starts the file with a UTF-8 byte order mark, which made line 1, a good row, "not valid JSON";
CRLF line ends are JSON whitespace already. A lone surrogate ("\\ud800", half of a UTF-16 pair, which json.dumps
writes for a broken emoji) decodes to text that no tokenizer and no print can take, and thousands of nested
brackets overflow the JSON reader's recursion: both crashed `validate-data` with a traceback; each is a row problem.
"""

from __future__ import annotations

import codecs
import json


class RowProblem(ValueError):
    def __init__(self, problem: str, fix: str):
        super().__init__(problem)
        self.problem, self.fix = problem, fix


def split_lines(raw: bytes) -> list[bytes]:
    """The file's lines, numbered from 1 by the caller; a byte order mark is not part of line 1."""
    return raw.removeprefix(codecs.BOM_UTF8).split(b"\n")


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
