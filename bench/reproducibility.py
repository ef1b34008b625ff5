"""Two CPU runs with the same seed: do their losses agree step for step, and if not, why not?

    python bench/reproducibility.py                     # every pair below: a run file in bench/results/runs/
    python bench/reproducibility.py --only default-avx2  # some variants only (a run file of their pairs)

Each run is what `NB_CI=1 python -m nb_helpers train --set ...` runs, in a fresh process (the CPU profile shrunk: the
embedded SmolLM2-135M, batch 2 x 2, 192 tokens, bf16 where the CPU has bf16 units), --steps optimizer steps, no
task scoring. The two runs of a pair run one after the other, so they share the machine the same way. Variants:
  default        the course as it is: attach_lora seeds torch with cfg.seed before get_peft_model draws LoRA's A
  default-avx2   the same with ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2: the
                 kernels an AVX2-only CPU (most laptops) runs, where auto picks fp32
  unseeded       attach_lora's seeding undone (what the course did before commit 6486a2e, and what testers saw): a
                 fresh process seeds torch at random, and the Trainer seeds it only after LoRA's A is drawn
  unseeded-avx2  the same, limited to AVX2
  threads1       default on one thread, run once and compared with default's first run (two threads)
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

from run_file import RunFile, add_out_dir, load_runs  # bench/ is on the path when this script runs

ROOT = Path(__file__).resolve().parent.parent
AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}

UNSEEDED = {"unseed_lora_init": True}
# name -> (environment, what the worker does to torch before training, variant whose first run is the other half)
VARIANTS = {
    "default": ({}, {}, None),
    "default-avx2": (AVX2, {}, None),
    "unseeded": ({}, UNSEEDED, None),
    "unseeded-avx2": (AVX2, UNSEEDED, None),
    "threads1": ({}, {"threads": 1}, "default"),
}


def worker(spec: dict) -> None:
    """Runs inside the fresh process: set up torch as the variant asks, report what it sees, then train."""
    import torch

    from nb_helpers.config import apply_sets, default_config
    from nb_helpers.plan.dtypes import cpu_report
    from nb_helpers.training import train

    if spec["torch"].get("threads"):
        torch.set_num_threads(spec["torch"]["threads"])
    if spec["torch"].get("unseed_lora_init"):
        unseed_lora_init()
    print("REPORT " + json.dumps({**cpu_report(), "threads": torch.get_num_threads()}), flush=True)
    train(apply_sets(default_config(), [f"{k}={v}" for k, v in spec["sets"].items()]), verbose=False)


def unseed_lora_init() -> None:
    """attach_lora as it was before 6486a2e: its `from transformers import set_seed` gets a no-op, so LoRA's A comes
    from the generator as the process left it. The Trainer keeps its own set_seed (bound at its import)."""
    import transformers

    transformers.set_seed = lambda *args, **kwargs: None


def one_run(name: str, steps: int, runs_dir: str, label: str) -> dict:
    env_changes, torch_changes, _ = VARIANTS[name]
    sets = {"max_steps": steps, "task_eval_samples": 0, "eval_steps": 0, "max_eval_samples": 2,
            "save_steps": 10_000, "runs_dir": runs_dir, "run_name": label}
    spec = {"sets": sets, "torch": torch_changes}
    env = {**os.environ, **env_changes, "NB_CI": "1", "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}/{label} failed:\n{proc.stderr[-3000:]}")
    report = next(json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("REPORT "))
    records = [json.loads(line) for line in (Path(runs_dir) / label / "metrics.jsonl").read_text().splitlines()]
    steps_done = [r for r in records if "loss" in r]
    return {"seconds": round(time.perf_counter() - started), "threads": report["threads"],
            "dtype": report["auto_dtype"], "capability": report["capability"],
            "losses": [r["loss"] for r in steps_done], "grad_norms": [r["grad_norm"] for r in steps_done]}


def max_relative_difference(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / abs(x) for x, y in zip(a, b) if x), default=0.0)


def run_pair(name: str, steps: int, rows: dict) -> dict:
    """Two runs of the variant; or, where it names another variant, one run against that variant's first."""
    env_changes, torch_changes, against = VARIANTS[name]
    with tempfile.TemporaryDirectory() as tmp:
        if against:
            if against not in rows or rows[against]["steps"] != steps:
                raise SystemExit(f"{name} is compared with {against}'s first run: run {against} first, at "
                                 f"--steps {steps}")
            runs = [rows[against]["runs"][0], one_run(name, steps, tmp, "b")]
        else:
            runs = [one_run(name, steps, tmp, label) for label in ("a", "b")]
    first, second = runs
    return {"variant": name, "environment": env_changes, "torch": torch_changes, "against": against,
            "steps": steps, "runs": runs,
            "max_relative_loss_difference": max_relative_difference(first["losses"], second["losses"]),
            "identical": first["losses"] == second["losses"] and first["grad_norms"] == second["grad_norms"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per run")
    parser.add_argument("--only", nargs="+", choices=sorted(VARIANTS), help="these variants (default: all)")
    parser.add_argument("--output", default=None, help="write the run file exactly here (default: --out-dir)")
    add_out_dir(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0

    sys.path.insert(0, str(ROOT))
    run_file = RunFile("reproducibility", out_dir=args.out_dir, out=args.output, device="cpu")
    # a variant compared with another's first run (threads1 with default) finds it in this run or the newest before
    before = {row["variant"]: row for run in load_runs("reproducibility") for row in run["results"]["pairs"]}
    rows, done = dict(before), {}
    for name in args.only or list(VARIANTS):
        row = rows[name] = done[name] = run_pair(name, args.steps, rows)
        print(f"{name:<12} max relative loss difference {row['max_relative_loss_difference']:.2%}, identical "
              f"{row['identical']} ({', '.join(str(r['seconds']) for r in row['runs'])} s a run)", flush=True)
        result = {"train_command": "NB_CI=1 python -m nb_helpers train --set max_steps=STEPS --set "
                                  "task_eval_samples=0 --set eval_steps=0 --set max_eval_samples=2 --set "
                                  "save_steps=10000",
                  "pairs": [done[n] for n in VARIANTS if n in done]}
        run_file.write(result)  # after each pair: a long bench keeps what it measured
    print(f"wrote {run_file.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
