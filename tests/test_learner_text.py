"""What a learner reads names the GPU, the date, the command or bench/RESULTS.md, never our bookkeeping: no device
call numbers ("call 73", "calls 60-62", "call73"), no "device call", no session or issue numbers, no commit hashes.
Learner text here: every notebook cell (markdown, code and any committed output), README.md and docs/*.md, and every
string constant and comment of the package (nb_helpers/**/*.py, read with ast and tokenize: a docstring or an error
message reaches a learner through help() or a traceback, and a comment through the source a notebook points at). Run
files and raw output under bench/results are records, not learner text: tests/test_benchmarks.py checks what learners
read of them (bench/RESULTS.md, bench/results/latest.json). Plain text checks, no imports from the package."""

import ast
import io
import json
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "docs" / "executed").glob("*.ipynb"))
PACKAGE = sorted((ROOT / "nb_helpers").rglob("*.py"))

BOOKKEEPING = {
    "device call": re.compile(r"\bdevice[\s_-]+calls?\b", re.I),
    "call number": re.compile(r"(?<![A-Za-z])calls?[\s_-]*#?\d+", re.I),
    "session number": re.compile(r"(?<![A-Za-z])sessions?[\s_-]*#?\d+", re.I),
    "issue number": re.compile(r"(?<![A-Za-z])issues?[\s_-]*#?\d+", re.I),
    # 7-40 hex digits, at least one digit and one letter a-f, as a whole word; not after "#" (a colour, #1f77b4),
    # nor "0x" (0x1f is not a word of its own) nor inside a longer word or number (8.29696364235133e-06)
    "commit hash": re.compile(r"(?<![\w#.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?!\w)"),
}


def bookkeeping(text: str) -> list[str]:
    """Each bookkeeping phrase in text, as 'kind: the match'."""
    return [f"{kind}: {m.group(0)!r}" for kind, pattern in BOOKKEEPING.items() for m in pattern.finditer(text)]


def cell_texts(path: Path):
    """(where, text) for each cell's source and for each text its outputs hold."""
    for index, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
        where = f"{path.name} cell {index} ({cell.get('id', '?')})"
        yield where, "".join(cell["source"])
        for output in cell.get("outputs", []):
            # what a reader sees: text, HTML, markdown; not images (base64) nor a widget's view (its model's id)
            texts = [output.get("text", "")] + [value for mime, value in (output.get("data") or {}).items()
                                                if mime.startswith("text/")]
            texts += [output.get("evalue", "")] + output.get("traceback", [])
            for text in texts:
                text = "".join(text) if isinstance(text, list) else str(text)
                text = re.sub(r"data:[\w/+.-]+;base64,[A-Za-z0-9+/=]+", "data:(an image)", text)  # a figure in HTML
                if text:
                    yield f"{where} output", text


def package_texts(path: Path):
    """(where, text) for each string constant (docstrings, f-string parts included) and each comment of a module."""
    source = path.read_text(encoding="utf-8")
    name = path.relative_to(ROOT)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield f"{name}:{node.lineno}", node.value
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield f"{name}:{token.start[0]} (comment)", token.string


def learner_texts():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        yield str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")
    for path in NOTEBOOKS:
        yield from cell_texts(path)
    for path in PACKAGE:
        yield from package_texts(path)


def found() -> list[str]:
    return [f"{where}: {hit}" for where, text in learner_texts() for hit in bookkeeping(text)]


def test_what_learners_read_holds_no_bookkeeping():
    assert len(NOTEBOOKS) >= 7 and len(PACKAGE) >= 50, "the scan found almost nothing: are the paths still right?"
    bad = found()
    assert not bad, "name the GPU, the date, the command or bench/RESULTS.md instead:\n" + "\n".join(bad)


def test_the_detector_catches_each_kind_and_leaves_ordinary_text_alone():
    caught = {
        "measured in device call 26": "device call",
        "two device calls": "device call",
        "see call 73": "call number",
        "calls 60-62": "call number",
        "raw/throughput-call73-pair.json": "call number",
        "Call #5": "call number",
        "from session 4": "session number",
        "issue 27": "issue number",
        "issue #8": "issue number",
        "issue27/calls": "issue number",
        "at 59b4ead": "commit hash",
        "pytest-gpu-bd9e0ef.log": "commit hash",
        "commit 0bf22c7e1d4a6b8c9f0e1d2c3b4a5f6e7d8c9b0a": "commit hash",
    }
    for text, kind in caught.items():
        kinds = {hit.split(":")[0] for hit in bookkeeping(text)}
        assert kind in kinds, (text, kinds)
    ordinary = ["GTX 1650", "8 x 2048", "8 × 512 tokens", "fp16", "bf16", "0x1f", "0xdeadbeef1", "deadbeef",
                "facade", "decade", "color: #1f77b4", "2026-12-03", "580.159.04", "1e-4", "3.81 GiB", "sm_75",
                "a function call", "recalls", "the call stack", "this session", "an issue with fp16",
                "dispatches 2 kernels", "tokenize 512 rows", "ours-bfloat16-gtx1650", "abcdef", "1234567",
                "sha256 " + "a1" * 32]
    for text in ordinary:
        assert not bookkeeping(text), (text, bookkeeping(text))


def test_the_scan_reads_notebook_outputs_and_package_comments(tmp_path):
    notebook = {"cells": [{"cell_type": "code", "id": "c", "source": ["x = 1\n"], "outputs": [
        {"output_type": "stream", "name": "stdout", "text": ["measured in call 12\n"]},
        {"output_type": "display_data", "data": {"text/markdown": "at 646270b"}}]}]}
    path = tmp_path / "t.ipynb"
    path.write_text(json.dumps(notebook))
    assert [bookkeeping(text) for _, text in cell_texts(path)] == [[], ["call number: 'call 12'"],
                                                                    ["commit hash: '646270b'"]]
    module = ROOT / "nb_helpers" / "_probe_for_test_learner_text.py"
    try:
        module.write_text('"""Fine."""\nX = f"see {1} issue 8"  # from device call 9\n', encoding="utf-8")
        hits = [(where.split(":", 1)[1], bookkeeping(text)) for where, text in package_texts(module)]
    finally:
        module.unlink()
    assert [h for h in hits if h[1]] == [("2", ["issue number: 'issue 8'"]),
                                         ("2 (comment)", ["device call: 'device call'", "call number: 'call 9'"])]
