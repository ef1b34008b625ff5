"""The GPU benchmark's results (bench/results/throughput.json, written by bench/throughput.py) as rows a notebook
can show: the reference recipe and our default path, per workload, measured in the same device call."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from nb_helpers.config import PROJECT_ROOT

THROUGHPUT_JSON = PROJECT_ROOT / "bench" / "results" / "throughput.json"
RECIPES = ("reference", "ours")  # the two runs every workload has; the levers' runs are for bench/NOTES.md


@dataclass
class BenchRow:
    workload: str
    recipe: str
    micro_batch: int
    accum: int
    tokens_per_s: float
    ratio: float  # tokens/s over the reference's, in the same call
    peak_device_gib: float  # NVML device "used", CUDA context included


@dataclass
class Benchmark:
    gpu: str
    date: str
    budget_gib: float
    rows: list[BenchRow]
    measured_at: dict[str, str]  # workload -> commit (workloads can come from different calls, never mixed in one)


def load_benchmark(path: str | Path = THROUGHPUT_JSON) -> Benchmark | None:
    """The reference and our path for every workload in the file; None when there is no file (a copy of the course
    without bench/results). A file without the expected fields raises a ValueError that names it."""
    path = Path(path)
    if not path.exists():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data.get("workloads"), dict):
        raise ValueError(f"{path}: no 'workloads' object; write it again with `python bench/throughput.py`")
    rows = []
    for workload, entry in data["workloads"].items():
        runs = entry.get("runs", {})
        if not all(runs.get(name, {}).get("tokens_per_s") for name in RECIPES):
            continue  # a workload whose reference or our run did not finish has no ratio to show
        base = runs["reference"]["tokens_per_s"]
        rows += [BenchRow(workload, name, runs[name]["micro_batch"], runs[name]["accum"], runs[name]["tokens_per_s"],
                          runs[name]["tokens_per_s"] / base, runs[name]["peak_device_gib"]) for name in RECIPES]
    return Benchmark(data.get("gpu", "?"), data.get("date", "?"), data.get("budget_gib", 4.0), rows,
                     data.get("measured_at_commit", {}))


def benchmark_markdown(bench: Benchmark) -> str:
    """One table; each workload's reference and our run come from one device call, named in the last column."""
    lines = [f"{bench.gpu}, {bench.date}, budget {bench.budget_gib:g} GiB including the CUDA context", "",
             "| workload | run | micro-batch × accum | tokens/s | × reference | peak GiB | measured at |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r.workload} | {r.recipe} | {r.micro_batch} × {r.accum} | {r.tokens_per_s:,.0f} | {r.ratio:.1f}× | "
              f"{r.peak_device_gib:.2f} | {bench.measured_at.get(r.workload, '?').split(' ')[0]} |" for r in bench.rows]
    return "\n".join(lines)
