"""bench/gpu_checks.sh, the whole suite in one device call (SHARDS=n): the GPU tests alone, the rest in n processes,
one log. Run here on a small suite of its own: the log holds every shard and counts the whole suite, and a time limit
that cuts the run leaves every finished shard in the log and names the unfinished one with the command for its
files. No GPU needed: the script only runs pytest."""

import os
import shutil
import signal
import subprocess
import sys
import time

from nb_helpers.config import PROJECT_ROOT

TESTS = {  # bash's glob order, round robin over 3 shards: 0 gets a and d, 1 gets b, 2 gets c
    "test_a.py": "import pytest\n\n@pytest.mark.gpu\ndef test_on_the_gpu():\n    pass\n\ndef test_a():\n    pass\n",
    "test_b.py": "def test_b():\n    pass\n\ndef test_fails():\n    assert 0\n",
    "test_c.py": "import time\n\ndef test_slow():\n    time.sleep(float(__import__('os').environ['SLOW_S']))\n",
    "test_d.py": "def test_d():\n    pass\n",
    # LINGER_S: the shard that runs test_c.py stays alive that long after printing its last line
    "conftest.py": "import os, sys, time\n\ndef pytest_unconfigure(config):\n    if any('test_c' in a for a in "
                   "config.args):\n        sys.stdout.flush()\n        time.sleep(float(os.environ.get('LINGER_S', "
                   "'0')))\n",
}


def start(tmp_path, slow_s: float, linger_s: float = 0) -> tuple[subprocess.Popen, object]:
    (tmp_path / "bench").mkdir()
    shutil.copy(PROJECT_ROOT / "bench" / "gpu_checks.sh", tmp_path / "bench")
    (tmp_path / "tests").mkdir()
    for name, text in TESTS.items():
        (tmp_path / "tests" / name).write_text(text)
    # the log's first lines name the versions (nb_helpers.summary, which imports the training stack: 8 s); here a
    # package of the same name answers at once, as the script finds the repository's own on its PYTHONPATH
    (tmp_path / "nb_helpers").mkdir()
    (tmp_path / "nb_helpers" / "__init__.py").write_text("")
    (tmp_path / "nb_helpers" / "summary.py").write_text("def package_versions():\n    return {'python': 'here'}\n")
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "SHARDS": "3", "PY": sys.executable,
           "OUT": str(tmp_path / "out"), "COMMIT": "t", "SLOW_S": str(slow_s),
           "LINGER_S": str(linger_s),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # no nbmake, xdist, ...: each pytest it starts loads at once
    proc = subprocess.Popen(["bash", "bench/gpu_checks.sh"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, tmp_path / "out" / "pytest-gpu-t.log"


def test_the_log_holds_every_shard_and_counts_the_whole_suite(tmp_path):
    proc, log = start(tmp_path, slow_s=0)
    proc.communicate(timeout=240)
    text = log.read_text()
    assert proc.returncode == 1, text  # a failed test fails the run
    assert "{'python': 'here'}" in text  # the versions header came from the package on the script's path
    assert "== -m gpu, alone" in text and all(f"shard {i} of 3 (exit" in text for i in range(3)), text
    assert "FAILED tests/test_b.py::test_fails" in text
    assert "== whole suite: 6 of the 6 tests collected ran (5 passed, 0 skipped, 1 failed, 0 errors)" in text, text
    assert not list((tmp_path / "out").glob("shard-*.log"))  # each went into the one log


def test_a_cut_run_keeps_the_finished_shards_and_names_the_rest(tmp_path):
    proc, log = start(tmp_path, slow_s=300)
    deadline = time.time() + 200
    while time.time() < deadline:  # both fast shards are in the log; the slow one still runs
        if log.exists() and all(f"shard {i} of 3 (exit" in log.read_text() for i in (0, 1)):
            break
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM)  # what `timeout` does at its limit: TERM to the script and its processes
    proc.communicate(timeout=120)
    text = log.read_text()
    assert proc.returncode == 124, text
    assert "shard 2 of 3: stopped unfinished" in text and "bash bench/gpu_checks.sh -m 'not gpu' tests/test_c.py" in text
    assert "== whole suite: 5 of the 6 tests collected ran (4 passed, 0 skipped, 1 failed, 0 errors); 1 not run" in text


def test_a_shard_that_ended_as_the_limit_came_is_not_called_unfinished(tmp_path):
    """A shard whose pytest printed its last line but was not yet reaped when the limit came ran whole: the log says
    so and names no command to run it again."""
    proc, log = start(tmp_path, slow_s=0, linger_s=300)
    deadline = time.time() + 200
    while time.time() < deadline:  # the fast shards are in; shard 2 has printed its summary and lingers
        shard = tmp_path / "out" / "shard-2.log"
        if log.exists() and all(f"shard {i} of 3 (exit" in log.read_text() for i in (0, 1)) and shard.exists() \
                and " passed in " in shard.read_text():
            break
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=120)
    text = log.read_text()
    assert proc.returncode == 124, text
    assert "shard 2 of 3 (finished as the time limit came)" in text and "stopped unfinished" not in text, text
    assert "== whole suite: 6 of the 6 tests collected ran (5 passed, 0 skipped, 1 failed, 0 errors); 0 not run" in text
