"""The course's time on this machine as a learner meets it: a fresh clone of this repository, `make setup`, then
`make executed` (every notebook in order on the embedded model, what `make run` runs) and, with --test, `make test`.
Each is timed; the run file also keeps the per-notebook times that `python -m nb_helpers course` prints and what the
runs it trained scored (notebook 03's SFT run, notebook 07's DPO run).

    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 python bench/course_time.py --test

The AVX2 variables make torch compute as most laptop CPUs do (README, "How long"). The clone's executed notebooks
(docs/executed/, which the README links) are copied into this checkout with --copy-executed. Time it on an idle
machine: anything else running shows up in every figure.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from run_file import RunFile, add_out_dir  # noqa: E402

NOTEBOOK_DONE = re.compile(r"\[course\] (\S+\.ipynb): (ok|FAILED) in (\d+) s")
RUN_KEYS = ("steps", "median_step_s", "task_metric", "task_base", "task_tuned", "pairs_reward_accuracy", "status")


def timed(command: list[str], cwd: Path, log: Path) -> tuple[float, int]:
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        code = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT).returncode
    return round(time.perf_counter() - start, 1), code


def trained_runs(clone: Path) -> dict:
    """The summaries of the runs the course trained: the SFT run and, when notebook 07 ran, its DPO run."""
    found = {}
    for summary in sorted((clone / "runs").glob("2*/summary.json")):
        data = json.loads(summary.read_text(encoding="utf-8"))
        found["dpo" if "preference_from" in data else "sft"] = {k: data.get(k) for k in RUN_KEYS}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--test", action="store_true", help="also time `make test` in the clone")
    parser.add_argument("--copy-executed", action="store_true", help="copy the clone's docs/executed/ here")
    add_out_dir(parser)
    args = parser.parse_args()
    run_file = RunFile("course", out_dir=args.out_dir, device="cpu")
    work = Path(tempfile.mkdtemp(prefix="course-time-"))
    clone, logs = work / "clone", work / "logs"
    logs.mkdir()
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    results: dict = {"clone_of": run_file.header.get("commit")}
    for step, target in (("setup", "setup"), ("run", "executed"), *((("test", "test"),) if args.test else ())):
        seconds, code = timed(["make", target], clone, logs / f"{step}.log")
        results[f"{step}_s"], results[f"{step}_exit"] = seconds, code
        if step == "run":
            text = (logs / "run.log").read_text(encoding="utf-8", errors="replace")
            results["notebooks_s"] = {name: int(s) for name, _, s in NOTEBOOK_DONE.findall(text)}
            results["runs"] = trained_runs(clone)
        print(f"[course-time] make {target}: {seconds:.0f} s, exit {code}", flush=True)
        run_file.write(results)
        if code != 0:
            print((logs / f"{step}.log").read_text(encoding="utf-8", errors="replace")[-3000:])
            break
    if args.copy_executed and (clone / "docs" / "executed").is_dir():
        shutil.copytree(clone / "docs" / "executed", ROOT / "docs" / "executed", dirs_exist_ok=True)
    print(json.dumps(results, indent=1))
    print(f"wrote {run_file.write(results)}; logs in {logs}")


if __name__ == "__main__":
    main()
