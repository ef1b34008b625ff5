"""The README a learner reads first: short, its first screen says how to start and what the course needs, every
tokens/s figure sits in a section that names the machine that measured it, and every repository path it names in
backticks exists. Plain text checks, no imports from the package: they take milliseconds."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

MAX_LINES = 150  # the learner's guide; measured tables live in bench/RESULTS.md, the module map in docs/layout.md
FIRST_SCREEN = 40  # lines a learner sees before scrolling
MACHINES = ("H200", "CPU")  # a tokens/s figure must say which of these measured it
FIGURE = re.compile(r"\btok(?:ens)?/s\b")  # a tokens/s column or figure
PATH_ENDINGS = (".py", ".json", ".md", ".ipynb", ".txt", ".log", ".sh")
GENERATED = ("runs/", ".venv/", ".cache/")  # made by running the course, not in the repository


def sections(text: str) -> list[tuple[str, list[str]]]:
    """(heading, its lines) for each heading of any level; headings inside code fences do not count."""
    found = [("", [])]
    fenced = False
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("#"):
            found.append((line, []))
        else:
            found[-1][1].append(line)
    return found


def figures_without_machine(text: str) -> list[str]:
    """Lines with a tokens/s figure (table rows, headers, prose) in a section that names no machine."""
    bad = []
    for heading, lines in sections(text):
        if any(machine in heading + "\n".join(lines) for machine in MACHINES):
            continue
        bad += [f"{heading or '(top)'}: {line.strip()[:80]}" for line in lines if FIGURE.search(line)]
    return bad


def named_paths(text: str) -> set[str]:
    """Repository paths inside backtick spans, also inside commands (`python bench/cpu_bench.py`); placeholders
    (`runs/<run>/...`), globs and generated folders are left out."""
    paths = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        for token in span.split():
            token = token.strip(".,;:()'\"").rsplit("=", 1)[-1]
            if "/" not in token or not token.endswith(PATH_ENDINGS) or "://" in token:
                continue
            if any(c in token for c in "<>*…") or token.startswith(GENERATED):
                continue
            paths.add(token)
    return paths


def missing_paths(text: str) -> list[str]:
    return sorted(p for p in named_paths(text) if not (ROOT / p).exists())


def first_screen_gaps(text: str) -> list[str]:
    screen = "\n".join(text.split("\n")[:FIRST_SCREEN])
    wanted = {
        "make lab or JupyterLab": r"make lab|JupyterLab",
        "notebook 00": r"\b00(?:_|\b)",
        "GPU": r"\bGPU\b",
        "host RAM": r"\bRAM\b",
    }
    return [name for name, pattern in wanted.items() if not re.search(pattern, screen)]


def line_count(text: str) -> int:
    return text.count("\n") + (not text.endswith("\n"))


def readme() -> str:
    return README.read_text(encoding="utf-8")


def test_the_readme_is_short():
    lines = line_count(readme())
    assert lines <= MAX_LINES, f"README.md has {lines} lines; keep it to {MAX_LINES}, figures go to bench/RESULTS.md"


def test_the_first_screen_says_how_to_start_and_what_it_needs():
    gaps = first_screen_gaps(readme())
    assert not gaps, f"the README's first {FIRST_SCREEN} lines do not mention: {gaps}"


def test_every_tokens_per_second_figure_names_its_machine():
    bad = figures_without_machine(readme())
    assert not bad, f"tokens/s figures in sections that name no machine ({' or '.join(MACHINES)}): {bad}"


def test_every_path_the_readme_names_exists():
    text = readme()
    assert len(named_paths(text)) >= 10, "the path check found almost no paths: is its pattern still right?"
    missing = missing_paths(text)
    assert not missing, f"README.md names paths that are not in the repository: {missing}"


def test_the_checks_notice_a_broken_readme():
    text = readme()
    assert line_count(text + "x\n" * (MAX_LINES + 1)) > MAX_LINES
    # the first screen pushed down by 40 blank lines mentions nothing
    assert first_screen_gaps("\n" * FIRST_SCREEN + text) == ["make lab or JupyterLab", "notebook 00", "GPU", "host RAM"]
    # a tokens/s table in a section that names no machine; the same table under an H200 heading passes
    table = "| run | tokens/s |\n|---|---|\n| ours | 38,855 |\n"
    assert figures_without_machine(text + "\n## Speed\n\n" + table) == ["## Speed: | run | tokens/s |"]
    assert figures_without_machine("## Speed\n\nours ran 38,855 tok/s.\n") == ["## Speed: ours ran 38,855 tok/s."]
    assert figures_without_machine("## Speed on one H200\n\n" + table) == []
    # a file that is not there, named alone or inside a command
    broken = text + "\nSee `bench/results/no-such-file.json` and `python bench/no_such_script.py --out x`.\n"
    assert missing_paths(broken) == ["bench/no_such_script.py", "bench/results/no-such-file.json"]
    assert named_paths("`runs/<run>/config.json` `runs/latest/summary.json` `https://example.org/a.json`") == set()
