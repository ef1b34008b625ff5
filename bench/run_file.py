"""One results file per benchmark run: bench/results/runs/<date>-<what>-<id>.json, written by the script that measured.

Every script under bench/ that measures something writes its figures through `RunFile`; nothing else writes there,
and no file in it is edited by hand. `bench/summarize.py` reads them all and writes what learners read
(bench/results/latest.json and bench/RESULTS.md).

    run = RunFile("throughput", out_dir=args.out_dir, out=args.out)   # at the start: machine, versions, command
    run.write(results)                                               # as often as it likes (after each point)

A run file holds:
  format      1
  kind        what ran (the <what> of the name): "throughput", "cpu", "reach", "multi-gpu", ...
  date        YYYY-MM-DD the run started (UTC)
  started     when it started, "YYYY-MM-DDTHH:MM:SSZ"; null in the files bench/split_results.py made from the
              aggregates this folder replaced (their order within a day is then their name's)
  command     the command line as typed (a list where one run was several invocations)
  environment the NB_* and ISA/thread variables set for it
  commit      the git commit measured, "+changes" appended when the tree had uncommitted changes; on a machine
              without the repository's history, BENCH_COMMIT names it; null when unknown
  machine     {"gpu", "gpu_count", "driver"} for a GPU run, {"cpu", "cores", "arch"} for a CPU one
  versions    the packages that ran
  results     every figure the script measured, as the script reports them
  notes       (optional) words recorded with the figures
The <id> is the start time (HHMMSS, UTC) and two random letters, so two runs never share a name (and no name reads
like a commit hash).

On the lent GPU machine pass --out-dir $OUT and copy what comes back with `cp $OUT/*.json bench/results/runs/`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RUNS = RESULTS / "runs"
FORMAT = 1
ENVIRONMENT = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
               "MKL_ENABLE_INSTRUCTIONS", "PYTORCH_CUDA_ALLOC_CONF")


def add_out_dir(parser, what: str = "the run file") -> None:
    parser.add_argument("--out-dir", default=str(RUNS),
                        help=f"folder for {what} (<date>-<what>-<id>.json); default bench/results/runs")


def command_line(argv: list[str] | None = None) -> str:
    argv = sys.argv if argv is None else argv
    return " ".join(["python", *(shlex.quote(a) for a in [Path(argv[0]).as_posix(), *argv[1:]])])


def git_commit() -> str | None:
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+changes" if changed else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_machine() -> dict:
    """Name, count and driver of the GPUs this process sees (nvidia-smi, else torch)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        out = []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if out:
        rows = [[part.strip() for part in line.split(",")] for line in out]
        if visible:
            picked = [rows[int(i)] for i in visible.split(",") if i.strip().isdigit() and int(i) < len(rows)]
            rows = picked or rows
        return {"gpu": rows[0][0], "gpu_count": len(rows), "driver": rows[0][1] if len(rows[0]) > 1 else None}
    try:
        import torch

        if torch.cuda.is_available():
            return {"gpu": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count(), "driver": None}
    except ImportError:
        pass
    return {"gpu": None, "gpu_count": 0, "driver": None}


def compute_apps() -> list[tuple[int, str, int]]:
    """(pid, GPU uuid, MiB) of every process holding memory on a GPU, as nvidia-smi lists them."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = []
    for line in text.strip().splitlines():
        pid, uuid, mib = (part.strip() for part in line.split(","))
        if mib.isdigit():
            rows.append((int(pid), uuid, int(mib)))
    return rows


def host_load() -> dict:
    """What else the machine carries as a run starts: the 1-minute load average over its cores and the processes
    holding GPU memory (pid, MiB). A host-bound run (the reference recipe) slows under other work, and memory others
    hold shifts the CUDA context's measured size: leftovers of an earlier command show up here."""
    return {"load_1min": round(os.getloadavg()[0], 2), "cores": os.cpu_count(),
            "gpu_processes": [[pid, mib] for pid, _, mib in compute_apps() if pid != os.getpid()]}


def cpu_machine() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "arch": platform.machine()}


def package_versions() -> dict:
    try:
        sys.path.insert(0, str(ROOT))
        from nb_helpers.summary import package_versions as versions

        return versions()
    except Exception:  # noqa: BLE001 - a bench run records what it can
        from importlib import metadata

        found = {"python": platform.python_version()}
        for name in ("torch", "transformers", "peft", "trl", "bitsandbytes", "accelerate", "datasets",
                     "liger-kernel", "triton"):
            try:
                found[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                found[name] = None
        return found


class RunFile:
    """The file one run writes, and its header, fixed when the run starts. `out` (a script's --out) names the file
    exactly; otherwise it is <out_dir>/<date>-<kind>-<id>.json."""

    def __init__(self, kind: str, *, out_dir: str | Path | None = None, out: str | Path | None = None,
                 device: str = "gpu", argv: list[str] | None = None, command: str | None = None):
        now = datetime.datetime.now(datetime.timezone.utc)
        self.header = {
            "format": FORMAT, "kind": kind, "date": now.date().isoformat(),
            "started": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "command": command or command_line(argv),
            "environment": {k: v for k, v in sorted(os.environ.items())
                            if (k.startswith("NB_") or k in ENVIRONMENT)},
            "commit": git_commit(), "machine": gpu_machine() if device == "gpu" else cpu_machine(),
            "versions": package_versions(),
        }
        name = f"{now.date().isoformat()}-{kind}-{now:%H%M%S}{''.join(secrets.choice('ghjkmnpqrstvwxyz') for _ in range(2))}.json"
        self.path = Path(out) if out else Path(out_dir or RUNS) / name

    def write(self, results: dict, notes: list[str] | None = None) -> Path:
        """The header and `results`, replacing what this run wrote before (a run killed midway keeps its points)."""
        data = {**self.header, "results": results}
        if notes:
            data["notes"] = notes
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)
        return self.path


# --- reading ------------------------------------------------------------------------------------------------------
def order(data: dict, name: str) -> tuple:
    """Oldest first: by date, then start time (migrated files have none and come first in their day), then name."""
    return data.get("date") or "", data.get("started") or "", name


def load_runs(kind: str | None = None, runs_dir: str | Path = RUNS) -> list[dict]:
    """Every run file (of one kind), oldest first; each dict gets "file": its path relative to the repository."""
    found = []
    for path in Path(runs_dir).glob("*.json"):
        data = json.loads(path.read_text(encoding="utf-8"))
        if kind is None or data.get("kind") == kind:
            try:
                rel = path.resolve().relative_to(ROOT).as_posix()
            except ValueError:
                rel = path.as_posix()
            found.append({**data, "file": rel})
    return sorted(found, key=lambda d: order(d, Path(d["file"]).name))


def newest(kind: str, runs_dir: str | Path = RUNS) -> dict | None:
    runs = load_runs(kind, runs_dir)
    return runs[-1] if runs else None


def migrated_workloads(file: str, record: str = "", runs_dir: str | Path = RUNS) -> dict:
    """The workloads (bench/throughput.py's layout) one record of an old aggregate held, read back from the run files
    bench/split_results.py made of it: `record` "" for the file's top level, "earlier/call20" for a nested one. For
    bench scripts that rebuild a report from the history."""
    prefix = f"{record}/workloads/" if record else "workloads/"
    found: dict = {}
    for run in load_runs(runs_dir=runs_dir):
        origin = run.get("migrated_from") or {}
        if origin.get("file") != f"bench/results/{file}":
            continue
        whole = not record and "" in origin["records"]  # the file was one run
        names = {r[len(prefix):] for r in origin["records"] if r.startswith(prefix)}
        for name, entry in (run["results"].get("workloads") or {}).items():
            if whole or name in names:
                found[name] = entry
    order = ("w512", "w2048", "shipped")
    return dict(sorted(found.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
