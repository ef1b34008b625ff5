"""Notebook 06, where the fast path is switched on and taught: every lever of nb_helpers.fast has its toy cell, the
committed plain-against-fast table names the GPU, the date and the command, the live comparison trains each config in
a process of its own; and on a GPU the notebook's live branch runs top to bottom (`-m gpu`, make test-gpu)."""

import json
import os
import re
import subprocess
import sys

import pytest

from nb_helpers.config import PROJECT_ROOT, RunConfig

NOTEBOOK = PROJECT_ROOT / "notebooks" / "06_going_faster.ipynb"
TOY_TAG = re.compile(r"\A# lever: ([a-z0-9_]+)\n")  # the first line of a lever's toy cell


def cells():
    return json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]


def test_every_lever_has_one_toy_cell_and_its_prose():
    """Each lever the fast path has (FastOptions' speed levers) gets exactly one toy cell, tagged `# lever: name`,
    and is named in the markdown before it; a lever taken out of the package cannot stay in the notebook."""
    from nb_helpers.fast import FastOptions

    levers = set(FastOptions().speed_levers())
    tagged, prose = [], ""
    for cell in cells():
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            prose = source
        elif found := TOY_TAG.match(source):
            tagged.append(found.group(1))
            assert f"`{found.group(1)}`" in prose, f"the toy of {found.group(1)} follows prose that does not name it"
    assert sorted(tagged) == sorted(set(tagged)), f"a lever with two toy cells: {tagged}"
    assert set(tagged) == levers, (f"levers without a toy cell: {sorted(levers - set(tagged))}; toy cells of levers "
                                   f"the package does not have: {sorted(set(tagged) - levers)}")


def test_the_toy_tag_check_notices_a_missing_and_an_unknown_lever():
    assert TOY_TAG.match("# lever: nomask\nimport torch").group(1) == "nomask"
    assert not TOY_TAG.match("import torch\n# lever: nomask\n")  # the tag is the cell's first line or nothing


def test_the_committed_plain_against_fast_table_names_gpu_date_and_command(tmp_path):
    from nb_helpers.ui.benchmarks import LATEST_JSON, plain_vs_fast_markdown

    text = plain_vs_fast_markdown()
    entries = json.loads(LATEST_JSON.read_text(encoding="utf-8"))["plain_vs_reference"]
    for entry in entries.values():
        row = next(line for line in text.splitlines() if line.startswith(f"| {entry['label']} |"))
        assert row.endswith(f"| {entry['machine']}, {entry['date']} |"), row
        assert f"{entry['plain']['tokens_per_s']:,.0f}" in row and f"{entry['ours']['tokens_per_s']:,.0f}" in row
    assert text.count("`python bench/throughput.py") == len({e["command"] for e in entries.values()})
    assert "--out" not in text
    assert plain_vs_fast_markdown(tmp_path / "missing.json") is None  # a copy without bench/results


def test_a_failed_live_run_says_why_with_its_last_lines(tmp_path, tiny_model_dir):
    from nb_helpers.ui.benchmarks import train_in_fresh_process

    cfg = RunConfig(model=str(tiny_model_dir), train_file=str(tmp_path / "no-such-rows.jsonl"),
                    runs_dir=str(tmp_path / "runs"),
                    run_name="plain", max_steps=1)
    with pytest.raises(RuntimeError, match=r"run plain failed \(exit \d+\); its last lines:\n(.|\n)*no-such-rows"):
        train_in_fresh_process(cfg)


RUN_NOTEBOOK = r"""
import sys, nbformat
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
for cell in nbformat.read(sys.argv[1], as_version=4).cells:
    if cell.cell_type == "code" and not shell.run_cell(cell.source).success:
        sys.exit(1)
"""


@pytest.mark.gpu
def test_notebook_06_measures_plain_against_fast_on_this_gpu(tiny_model_dir, tmp_path):
    """The GPU branch of notebook 06, top to bottom as a kernel runs it (NB_CI=1, the tiny model through NB_CONFIG):
    both live runs train, the fast one with its levers on, and the cell says what this GPU gains."""
    config = tmp_path / "model.json"
    config.write_text(json.dumps({"model": str(tiny_model_dir)}))
    env = {**os.environ, "NB_CI": "1", "NB_CONFIG": str(config), "MPLBACKEND": "Agg"}
    ran = subprocess.run([sys.executable, "-c", RUN_NOTEBOOK, str(NOTEBOOK)], cwd=PROJECT_ROOT / "notebooks",
                         env=env, capture_output=True, text=True, timeout=1200)
    out = ran.stdout + ran.stderr
    assert ran.returncode == 0, out[-4000:]
    assert re.search(r"^plain: [\d,]+ tokens/s", out, re.M) and re.search(r"^fast: [\d,]+ tokens/s", out, re.M), out
    assert "   [fast] levers on:" in out, out[-4000:]
    assert re.search(r"measured now on your .+: the fast path trains \d+\.\d\dx the tokens per second", out), out
