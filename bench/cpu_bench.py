"""CPU training speed per instruction set and dtype, on the embedded SmolLM2-135M (the `make run` model).

    python bench/cpu_bench.py                 # the full grid: a run file in bench/results/runs/ (bench/run_file.py)
    python bench/cpu_bench.py --steps 4 --only avx2   # a quicker look at one ISA limit

Each variant runs in a fresh process, because the ISA limits are read when torch starts:
  native  this CPU as it is
  avx2    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2: behaves like the
          AVX2-only CPUs most laptops and desktops have (no AVX-512, no AMX, so no native bf16)

A variant is `python -m nb_helpers train` on the shipped data with the CPU profile's knobs, no evaluation and
no task scoring, for --steps optimizer steps. A "DPO" variant is notebook 07's DPO step instead (the shipped pairs,
DPOConfig from nb_helpers.dpo.dpo_arguments, the reference = a frozen copy of the adapter), on a fresh adapter: the
speed is the same as on the SFT one. It reports the median seconds per optimizer step after the first
one (which pays for allocation), and non-padding tokens per second. A variant that passes --timeout is stopped
and reported with the steps it finished (bf16 on AVX2 is the slow case this bench exists to show).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from run_file import RunFile, add_out_dir, cpu_model  # noqa: E402

ISA_LIMITS = {
    "native": {},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}

# (name, config changes against the CPU profile). Each is one lever, measured alone against the profile.
def variants() -> list[tuple[str, dict]]:
    return [
        ("profile (auto dtype)", {}),
        ("bf16 autocast", {"compute_dtype": "bfloat16"}),
        ("fp32", {"compute_dtype": "float32"}),
        ("gradient checkpointing on", {"gradient_checkpointing": True}),
        ("16-bit base (no 4-bit)", {"load_in_4bit": False}),
        ("1 thread", {"__threads": 1}),
        ("1 x 8 (the reference's batch)", {"micro_batch_size": 1, "grad_accum": 8}),
        ("8 x 1", {"micro_batch_size": 8, "grad_accum": 1}),
        ("2 x 4", {"micro_batch_size": 2, "grad_accum": 4}),
        ("DPO: profile", {"__dpo": True}),
        ("DPO: 8 x 1 pairs", {"__dpo": True, "micro_batch_size": 8, "grad_accum": 1}),
        ("DPO: 2 x 4 pairs", {"__dpo": True, "micro_batch_size": 2, "grad_accum": 4}),
        ("DPO: 1 x 8 pairs", {"__dpo": True, "micro_batch_size": 1, "grad_accum": 8}),
    ]


def matmul_gflops(n: int = 1024, reps: int = 5) -> dict:
    """fp32 and bf16 matmul throughput: the root cause, without the training stack around it."""
    import torch

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        start = time.perf_counter()
        count = 0
        while count < reps or time.perf_counter() - start < 0.5:
            a @ b
            count += 1
            if time.perf_counter() - start > 20:  # emulated bf16 can take seconds per call: stop early
                break
        out[str(dtype).replace("torch.", "")] = round(2 * n**3 * count / (time.perf_counter() - start) / 1e9, 1)
    return out


def worker(spec: dict) -> None:
    """Runs inside the limited process: report what torch sees, then train."""
    import torch

    from nb_helpers.config import CPU_OVERRIDES, RunConfig
    from nb_helpers.plan.dtypes import cpu_report
    from nb_helpers.training import train

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    print("REPORT " + json.dumps({**cpu_report(), "matmul_gflops": matmul_gflops(), "threads": torch.get_num_threads()}),
          flush=True)
    cfg = RunConfig(**{**CPU_OVERRIDES, **spec["changes"], "max_steps": spec["steps"], "eval_file": None,
                       "task_eval_samples": 0, "eval_steps": 0, "save_steps": 10_000,
                       "runs_dir": spec["runs_dir"], "run_name": "bench"})
    if spec.get("dpo"):
        dpo_steps(cfg.replace(dpo_max_steps=spec["steps"]), Path(spec["runs_dir"]) / "bench")
    else:
        train(cfg, verbose=False)


def dpo_steps(cfg, run_dir: Path) -> None:
    """Notebook 07's DPO trainer for cfg.dpo_max_steps steps, its metrics.jsonl in run_dir."""
    from peft import get_peft_model
    from trl import DPOConfig, DPOTrainer

    from nb_helpers.dpo import PreferenceMetrics, adapt_dpo_trainer, dpo_arguments
    from nb_helpers.lora import lora_config
    from nb_helpers.models import load_4bit, load_tokenizer, resolve_model
    from nb_helpers.pairs import load_pairs, pair_dataset

    choice = resolve_model(cfg, verbose=False)
    tokenizer = load_tokenizer(choice.path)
    pairs = load_pairs(cfg.pairs_train_file, cfg, None, tokenizer)
    model = get_peft_model(load_4bit(cfg, choice), lora_config(cfg))
    run_dir.mkdir(parents=True)
    trainer = DPOTrainer(model=model, args=DPOConfig(**dpo_arguments(cfg, run_dir / "checkpoints", has_eval=False)),
                         train_dataset=pair_dataset(pairs), processing_class=tokenizer,
                         callbacks=[PreferenceMetrics(run_dir / "metrics.jsonl")])
    adapt_dpo_trainer(trainer, cfg)
    trainer.train()


def run_variant(isa: str, name: str, changes: dict, steps: int, timeout: float) -> dict:
    changes = dict(changes)
    threads, dpo = changes.pop("__threads", None), changes.pop("__dpo", False)
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"changes": changes, "steps": steps, "runs_dir": tmp, "threads": threads, "dpo": dpo}
        env = {**os.environ, **ISA_LIMITS[isa], "PYTHONUNBUFFERED": "1"}
        started = time.time()
        try:
            proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env, cwd=ROOT,
                                  capture_output=True, text=True, timeout=timeout)
            stopped, out = False, proc.stdout
            if proc.returncode != 0:
                raise RuntimeError(f"{isa}/{name} failed:\n{proc.stderr[-3000:]}")
        except subprocess.TimeoutExpired as e:
            stopped, out = True, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        report = next((json.loads(l[7:]) for l in out.splitlines() if l.startswith("REPORT ")), {})
        metrics = Path(tmp) / "bench" / "metrics.jsonl"
        records = [json.loads(l) for l in metrics.read_text().splitlines()] if metrics.exists() else []
    records = [r for r in records if "loss" in r]
    timed = records[1:] if len(records) > 1 else records
    step_s = statistics.median(r["step_s"] for r in timed) if timed else None
    counted = [r["tokens"] for r in timed if r.get("tokens")]
    tokens = statistics.median(counted) if counted else None  # DPO steps: TRL counts no tokens there
    return {"isa_limit": isa, "variant": name, "phase": "dpo" if dpo else "sft", "changes": changes, "threads": report.get("threads"),
            "compute_dtype": changes.get("compute_dtype") or report.get("auto_dtype"),
            "steps_done": len(records), "stopped_after_s": round(time.time() - started) if stopped else None,
            "median_step_s": None if step_s is None else round(step_s, 3),
            "tokens_per_s": None if not (step_s and tokens) else round(tokens / step_s, 1),
            "losses": [round(r["loss"], 4) for r in records], "torch_sees": report}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per variant (the first is not timed)")
    parser.add_argument("--only", choices=sorted(ISA_LIMITS), help="one ISA limit instead of both")
    parser.add_argument("--variants", default=None,
                        help="comma list of variant names to run (default: all), e.g. 'profile (auto dtype),1 x 8 (the reference's batch)'")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before a variant is stopped")
    parser.add_argument("--output", default=None, help="write the run file exactly here (default: --out-dir)")
    add_out_dir(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0

    sys.path.insert(0, str(ROOT))
    from nb_helpers.config import CPU_OVERRIDES

    run_file = RunFile("cpu", out_dir=args.out_dir, out=args.output, device="cpu")
    result = {"profile": CPU_OVERRIDES, "steps": args.steps, "isa_limits": ISA_LIMITS, "rows": []}
    rows = result["rows"]
    for isa in [args.only] if args.only else list(ISA_LIMITS):
        for name, changes in variants():
            if args.variants and name not in args.variants.split(","):
                continue
            row = run_variant(isa, name, changes, args.steps, args.timeout)
            rows.append(row)
            took = f"{row['median_step_s']} s/step" if row["median_step_s"] else "no step timed"
            print(f"{isa:<7} {name:<34} {row['compute_dtype'] or '?':<9} {took:<16} "
                  f"{row['tokens_per_s'] or '-':>8} tok/s  steps {row['steps_done']}"
                  + (f"  (stopped after {row['stopped_after_s']} s)" if row["stopped_after_s"] else ""), flush=True)
            run_file.write(result)  # after every variant: a long bench keeps what it measured
    print(f"wrote {run_file.write(result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
