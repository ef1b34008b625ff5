"""Several GPUs (issue 12): the same training at the same global batch on 1 GPU, then on 2 through
`accelerate launch`, each a fresh process tree, exactly as a user runs it. Reports tokens/s per world size and the
scaling factor (target: >= 1.8x at 2 GPUs), the first 20 losses of each (they should agree within bf16 noise), the
peak device memory of every GPU and the global batch.

One config file serves every world size: micro-batch 8 x accumulation 2 (16 sequences of 512 tokens per optimizer
step). On 1 GPU it trains as written; on 2, nb_helpers.distributed splits it to 8 x 1 on each GPU and says so. Model:
the TinyLlama-1.1B shape with random weights (bench/build_tinyllama_shape.py), W512-like rows
(bench/planner_grid.write_rows: 497-511 tokens, so micro-batches carry a little padding), r=8 on q,k,v,o,
gradient checkpointing on with the layers as CUDA graphs (--eager: without) and a 4 GiB budget per GPU, context
included: the settings auto-fit chose for 8 x 512 on the 4 GiB card (bench/RESULTS.md), so each GPU runs
what the course runs on one. LoRA dropout is 0:
each process draws its own dropout masks, so with dropout the curves would differ by the masks as well as by
rounding; --dropout 0.05 is the course's default.

    python bench/multi_gpu.py                   # 2 x H200: about 3 minutes; a run file in bench/results/runs/
    python bench/multi_gpu.py --worlds 1,2,4    # more GPUs, if the machine has them
    python bench/multi_gpu.py --allow-cpu --model-dir DIR --seq 64 --micro 2 --steps 5 --out /tmp/m.json
                                                # a dry run of this script on a CPU (gloo), with a small model
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
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from run_file import RunFile, add_out_dir, compute_apps  # noqa: E402
from throughput import WARMUP  # noqa: E402  (3 warm-up steps)

from nb_helpers.distributed import free_port  # noqa: E402

LOSSES_COMPARED = 20


def train_command(world: int, config: Path, profile_dir: Path | None = None) -> list[str]:
    """What a user types: `python -m nb_helpers train` on one GPU, `accelerate launch` on several. With a
    profile_dir, the same under cProfile (bench/profile_train.py), one report per process."""
    train = ["-m", "nb_helpers", "train", "--config", str(config)]
    if profile_dir is not None:
        train = [str(ROOT / "bench" / "profile_train.py"), str(profile_dir / f"world{world}"), "--config", str(config)]
    if world == 1:
        return [sys.executable, *train]
    # --mixed_precision no only silences accelerate's defaults notice: the Trainer's bf16=True sets the precision
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(world),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), *train]


def write_config(args, model_dir: Path, data: Path, work: Path, world: int) -> Path:
    from nb_helpers.config import RunConfig

    cfg = RunConfig(model=str(model_dir), train_file=str(data), eval_file=None, task_eval_samples=0,
                    max_length=args.seq, micro_batch_size=args.micro, grad_accum=args.global_batch // args.micro,
                    gradient_checkpointing=not args.no_gc, max_steps=args.steps, save_steps=10_000,
                    lora_dropout=args.dropout, cuda_graphs=not args.eager,
                    budget_gib=args.budget or None, compute_dtype="bfloat16" if not args.allow_cpu else "auto",
                    runs_dir=str(work / f"runs-{world}"), run_name="run", logging_steps=1, fast_path=True)
    path = work / f"config-{world}.json"  # the same knobs for every world size; only the runs folder differs
    cfg.save(path)
    return path


def run_sampling_apps(command: list[str], env: dict, timeout_s: float, sample: bool):
    """Run the command to the end; meanwhile (on GPUs) note the most memory each process held on each GPU: a process
    that holds memory on a GPU other than its own shows up as a second row with its pid."""
    peaks: dict[tuple[int, str], int] = {}
    deadline = time.time() + timeout_s
    # output goes to files, not pipes: a pipe nobody reads while sampling would fill up and stall the run
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err, text=True, cwd=ROOT, env=env)
        while proc.poll() is None and time.time() < deadline:
            for pid, uuid, mib in compute_apps() if sample else []:
                peaks[(pid, uuid)] = max(mib, peaks.get((pid, uuid), 0))
            time.sleep(1.0)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    apps = [{"pid": pid, "gpu": uuid[-8:], "max_used_mib": mib} for (pid, uuid), mib in sorted(peaks.items())]
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr), apps


def measure(world: int, config: Path, work: Path, threads: int, timeout_s: float,
            profile_dir: Path | None = None) -> dict:
    """One run in a fresh process (tree); its numbers come from the run folder rank 0 wrote."""
    import torch

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    for name in ("NB_CI", "NB_CONFIG", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(name, None)
    command, t0 = train_command(world, config, profile_dir), time.time()
    proc, apps = run_sampling_apps(command, env, timeout_s, sample=torch.cuda.is_available())
    row = {"world_size": world, "wall_s": round(time.time() - t0, 1), "returncode": proc.returncode,
           "command": " ".join("python" if c == sys.executable else c for c in command), "compute_apps": apps}
    run = Path(json.loads(config.read_text())["runs_dir"]) / "run"
    metrics = run / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    records = [r for r in records if "loss" in r]
    if records:
        timed = records[WARMUP:]  # as bench/throughput.py: the median step after the warm-up, tokens over seconds
        step_s = statistics.median(r["step_s"] for r in timed) if timed else None
        tokens = statistics.median(r["tokens"] for r in timed) if timed else None
        row.update(tokens_per_s=tokens / step_s if step_s and tokens else None, median_step_s=step_s,
                   tokens_per_step=tokens, timed_steps=len(timed), steps=len(records),
                   losses=[round(r["loss"], 4) for r in records[:LOSSES_COMPARED]])
    summary_path = run / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        per_device = summary.get("peak_vram_gib_per_process") or [summary.get("peak_vram_gib")]
        row.update(global_batch=summary.get("global_batch"), per_process_batch=summary.get("per_process_batch"),
                   peak_device_gib=per_device, peak_reserved_gib_rank0=summary.get("peak_reserved_gib"),
                   context_gib=summary.get("cuda_context_gib"), status=summary.get("status"),
                   summary_tokens_per_s=summary.get("tokens_per_s"))
    row["log"] = [line for line in proc.stdout.splitlines() if line.startswith(("[multi]", "[budget]", "[fast]"))]
    if proc.returncode != 0:
        row["error_tail"] = (proc.stderr or proc.stdout)[-3000:]
    return row


def compare(out: dict) -> None:
    """Scaling against one GPU, and how far the loss curves drift apart (bf16 noise, or a bug)."""
    one = out["worlds"].get("1", {})
    for key, row in out["worlds"].items():
        if key == "1" or not one.get("tokens_per_s") or not row.get("tokens_per_s"):
            continue
        row["scaling"] = row["tokens_per_s"] / one["tokens_per_s"]
        a, b = one.get("losses") or [], row.get("losses") or []
        pairs = list(zip(a, b))
        if pairs:
            row["loss_max_abs_diff"] = max(abs(x - y) for x, y in pairs)
            row["loss_max_rel_diff"] = max(abs(x - y) / max(abs(x), 1e-9) for x, y in pairs)
    two = out["worlds"].get("2", {})
    out["scaling_2_gpus"] = two.get("scaling")
    out["target_met"] = None if two.get("scaling") is None else two["scaling"] >= out["target_scaling"]


def gpu_facts(allow_cpu: bool) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"gpu": "none (CPU dry run, gloo)", "gpu_count": 0}
    facts = {"gpu": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count()}
    try:
        facts["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True).stdout.strip().splitlines()[0]
        facts["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True,
                                           text=True).stdout.strip().splitlines()[:4]
    except Exception:  # noqa: BLE001 - facts for the record, not needed to measure
        pass
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="1,2", help="comma list of process counts, one GPU each")
    parser.add_argument("--steps", type=int, default=WARMUP + LOSSES_COMPARED, help="optimizer steps per run")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro", type=int, default=8, help="micro-batch per GPU")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step, all GPUs")
    parser.add_argument("--budget", type=float, default=4.0, help="GiB per GPU, context included (0: none)")
    parser.add_argument("--no-gc", action="store_true", help="without gradient checkpointing")
    parser.add_argument("--eager", action="store_true",
                        help="eager layers (a hand-set run's default); without it, CUDA graphs as auto-fit picks them")
    parser.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout (0: comparable loss curves)")
    parser.add_argument("--model-dir", default="/tmp/shape-tinyllama-1.1b")
    parser.add_argument("--out", default=None, help="write the run file exactly here (default: --out-dir)")
    add_out_dir(parser)
    parser.add_argument("--timeout-s", type=float, default=240, help="per run")
    parser.add_argument("--allow-cpu", action="store_true", help="dry run without GPUs (processes on the CPU, gloo)")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP threads per process (default: the CPU's cores over the most processes)")
    parser.add_argument("--profile-dir", default=None, help="run each process under cProfile; reports go here")
    args = parser.parse_args()

    import torch

    worlds = [int(w) for w in args.worlds.split(",")]
    if not args.allow_cpu and torch.cuda.device_count() < max(worlds):
        sys.exit(f"bench/multi_gpu.py needs {max(worlds)} CUDA GPUs (found {torch.cuda.device_count()}); "
                 "--allow-cpu runs a dry run on the CPU")
    if args.global_batch % args.micro or any(args.global_batch % (args.micro * w) for w in worlds):
        sys.exit(f"--global-batch {args.global_batch} must be a multiple of --micro {args.micro} x each world size")
    start = time.time()
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        from build_tinyllama_shape import build

        build("tinyllama-1.1b", str(model_dir), ROOT / "data")
    work = Path(tempfile.mkdtemp(prefix="multi-gpu-"))
    data = work / f"w{args.seq}.jsonl"
    from planner_grid import write_rows
    from transformers import AutoTokenizer

    write_rows(AutoTokenizer.from_pretrained(model_dir), data, args.steps * args.global_batch, args.seq, seed=args.seq)
    # every run gets the share a process has at the most GPUs
    threads = args.threads or max(1, (os.cpu_count() or 2) // max(worlds))
    facts = gpu_facts(args.allow_cpu)
    run_file = RunFile("multi-gpu", out_dir=args.out_dir, out=args.out, device="gpu" if facts["gpu_count"] else "cpu")
    out = {**facts, "model": "TinyLlama-1.1B shape, random weights (bench/build_tinyllama_shape.py)"
           if args.model_dir == parser.get_default("model_dir") else str(model_dir),
           "seq": args.seq, "global_batch": args.global_batch, "micro_batch_per_gpu": args.micro,
           "gradient_checkpointing": not args.no_gc, "cuda_graphs": not args.eager,
           "budget_gib_per_gpu": args.budget or None,
           "lora_dropout": args.dropout,
           "steps": args.steps, "warmup_steps": WARMUP, "omp_threads_per_process": threads,
           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "target_scaling": 1.8,
           "setup_s": round(time.time() - start, 1), "worlds": {}}
    for world in worlds:
        row = measure(world, write_config(args, model_dir, data, work, world), work, threads, args.timeout_s,
                      Path(args.profile_dir) if args.profile_dir else None)
        out["worlds"][str(world)] = row
        compare(out)
        run_file.write(out)  # after every run: a partial result survives
        print(f"[multi-gpu] {world} process(es): {row.get('per_process_batch')} per process, global batch "
              f"{row.get('global_batch')} | {row.get('median_step_s') or float('nan'):.3f} s/step | "
              f"{row.get('tokens_per_s') or 0:,.0f} tok/s | x{row.get('scaling') or 1:.2f} | peak GiB per device "
              f"{row.get('peak_device_gib')} | rc={row['returncode']} {row['wall_s']} s", flush=True)
        if row["returncode"] != 0:
            print("    " + row.get("error_tail", "")[-1500:].replace("\n", "\n    "), flush=True)
    out["total_s"] = round(time.time() - start, 1)
    path = run_file.write(out)
    print(f"[multi-gpu] scaling at 2 GPUs: {out.get('scaling_2_gpus')} (target {out['target_scaling']}); "
          f"losses max rel diff {out['worlds'].get('2', {}).get('loss_max_rel_diff')}; {out['total_s']} s in all; "
          f"wrote {path}")


if __name__ == "__main__":
    main()
