"""Static checks on the notebooks: clean, valid, parseable, and following the course skeleton.
(nbmake runs them top to bottom in `make test`.)"""

import ast
import json
import re

import pytest

from nb_helpers.config import PROJECT_ROOT

NOTEBOOKS = sorted((PROJECT_ROOT / "notebooks").glob("*.ipynb"))


def test_the_course_is_complete_and_ordered():
    names = [p.name for p in NOTEBOOKS]
    assert names == ["00_environment_check.ipynb", "01_load_4bit.ipynb", "02_attach_lora.ipynb", "03_train.ipynb",
                     "04_metrics_analysis.ipynb", "05_try_the_model.ipynb", "06_going_faster.ipynb",
                     "07_preference_tuning.ipynb"]
    assert all(re.fullmatch(r"\d\d_[a-z0-9_]+\.ipynb", n) for n in names)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_clean_valid_and_follows_the_skeleton(path):
    import nbformat

    raw = json.loads(path.read_text(encoding="utf-8"))
    assert all(cell.get("id") for cell in raw["cells"]), "every cell needs an id (nbformat 4.5; a missing one warns now)"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "commit notebooks clean: make clean-notebooks"
    for cell in code:
        ast.parse(cell.source)
        assert "trust_remote_code=True" not in cell.source
    markdown = [c.source for c in nb.cells if c.cell_type == "markdown"]
    assert markdown[0].startswith("# " + path.name[:2] + " · ")
    assert any(m.startswith("## 1. Setup") for m in markdown)
    assert any(re.match(r"## \d+\. Recap", m) for m in markdown)
    runs, current = [], None  # prose before code: every run of code cells follows a markdown cell
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            current = None
        elif current is None:
            current = [index]
            runs.append(current)
        else:
            current.append(index)
    for run in runs:
        assert run[0] > 0 and nb.cells[run[0] - 1].cell_type == "markdown", f"cell {run[0]} has no prose before it"
        assert len(run) <= 2, f"cells {run}: more than two code cells in a row; say why in markdown between them"
    assert nb.cells[0].cell_type == "markdown"
    assert json.loads(path.read_text())["metadata"].get("widgets") is None


PROSE_WORDS_MAX = 3000  # a notebook is a lesson, not a log: past this, split it or cut it
WORD = re.compile(r"\S*[^\W_]\S*")  # a run of non-space holding a letter or digit: "-", "##", "|" and "×" are not words


def prose_words(nb) -> int:
    """Words of prose: the markdown cells' words (code, its comments and outputs not counted; markdown's own marks,
    a bullet's "-", a heading's "##", a table's "|", are not words)."""
    return sum(len(WORD.findall(cell.source)) for cell in nb.cells if cell.cell_type == "markdown")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_prose_is_at_most_3000_words(path):
    import nbformat

    words = prose_words(nbformat.read(path, as_version=4))
    assert words <= PROSE_WORDS_MAX, f"{path.name}: {words:,} words of markdown, more than {PROSE_WORDS_MAX:,}"


def test_prose_words_count_markdown_only():
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("## 1. Setup\n\n- three `more` words, 8 × 1"),
                                         nbformat.v4.new_code_cell("x = 1  # a comment of many words here")])
    assert prose_words(nb) == 7  # 1. Setup three `more` words, 8 1
