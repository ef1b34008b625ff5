"""The course's notebooks top to bottom on a machine with a GPU, as a learner's `make run` runs them there: each in a
process of its own (as each has its own kernel), cell by cell in IPython's shell (what a Jupyter kernel runs), with
NB_CI=1. It reports, per notebook, whether every cell ran and the first error, in a run file (bench/run_file.py)
under --out-dir (default: the --out folder, so it comes back with the logs); the notebooks' output goes to
<out>/course-<notebook>.log.

    python bench/course_on_gpu.py --out DIR                 # the embedded model, as make run uses it
    python bench/course_on_gpu.py --out DIR --random-weights   # offline (the lent device): the embedded model's
                                                            # shape and tokenizer, random weights

With --random-weights the answers and the task metric are meaningless; what it checks is that every cell runs on the
GPU path (fused layers, auto-fit, graphs, export) with the course's own code.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from run_file import RunFile  # noqa: E402

RUN_ONE = r"""
import sys, traceback, nbformat
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_cell("import os; os.chdir('notebooks')")
notebook = nbformat.read(sys.argv[1], as_version=4)
for number, cell in enumerate(c for c in notebook.cells if c.cell_type == "code"):
    result = shell.run_cell(cell.source)
    if not result.success:
        error = result.error_in_exec or result.error_before_exec
        print(f"\n@@ cell {number} failed: {type(error).__name__}: {str(error)[:400]}", flush=True)
        sys.exit(1)
print("\n@@ every cell ran", flush=True)
"""


def random_weight_model(out: Path) -> Path:
    """The embedded model's config and tokenizer (NB_CACHE_DIR holds them on the device) with random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from nb_helpers.models import embedded_model_dir

    source = embedded_model_dir()
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--notebooks", default="00,01,02,03,04,05,06")
    parser.add_argument("--out-dir", default=None, help="folder for the run file (default: --out)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_file = RunFile("course-on-gpu", out_dir=args.out_dir or out)
    env = {**os.environ, "NB_CI": "1", "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"),
                                                                                    str(ROOT)]))}
    if args.random_weights:
        config = Path(tempfile.mkdtemp(prefix="course-model-")) / "course-model.json"
        config.write_text(json.dumps({"model": str(random_weight_model(Path("/tmp/course-random-model")))}))
        env["NB_CONFIG"] = str(config)
    results = []
    for prefix in args.notebooks.split(","):
        notebook = next((ROOT / "notebooks").glob(f"{prefix}_*.ipynb"))
        start = time.perf_counter()
        ran = subprocess.run([sys.executable, "-c", RUN_ONE, str(notebook)], cwd=ROOT, env=env,
                             capture_output=True, text=True)
        log = out / f"course-{notebook.stem}.log"
        log.write_text(ran.stdout + "\n--- stderr ---\n" + ran.stderr)
        last = [line for line in ran.stdout.splitlines() if line.startswith("@@ ")]
        results.append({"notebook": notebook.name, "ok": ran.returncode == 0, "seconds": round(time.perf_counter() - start, 1),
                        "result": last[-1][3:] if last else f"exit {ran.returncode}: {ran.stderr.strip()[-300:]}"})
        print(f"{notebook.name:32s} {'ok' if ran.returncode == 0 else 'FAILED':6s} {results[-1]['seconds']:6.1f} s  "
              f"{results[-1]['result']}", flush=True)
        run_file.write({"random_weights": args.random_weights, "notebooks": results})
    print(f"wrote {run_file.path}")
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
