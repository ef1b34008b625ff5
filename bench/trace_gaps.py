"""Where a profiled step leaves the GPU idle: read a torch.profiler Chrome trace (CPU and CUDA activities) and
attribute every gap in the GPU's work to what the host was doing when it finally launched the kernel that ended it.

    python bench/trace_gaps.py trace.json.gz            # the gaps, grouped, biggest first
    python bench/throughput.py --workloads w2048 --trace DIR   # writes DIR/<workload>-<run>.json.gz

A gap ends with a kernel or copy. Its launch (matched by the trace's correlation id) sits inside CPU ops on some
thread: the outermost of them names the phase (an optimizer step, an autograd node, a forward op) and the innermost
the call that launched it. If the launch came before the gap began, the GPU was not waiting for the host but for
another stream (an event or a stream wait): such gaps are counted apart as "waited on another stream".

A GPU-only trace (`throughput.py --gpu-trace`: no host ops, so little slowdown) still says where the compute idles:
`compute_gaps_ms` is the idle time between compute kernels (copies left out: a checkpoint's copy beside an idle
compute stream is not work), and `largest_compute_gaps` lists the longest stretches with the kernels on either side,
from the start of the step."""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict
from pathlib import Path

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
CPU_CATS = {"cpu_op", "user_annotation"}
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ", "cudaMemcpy")


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        data = json.load(handle)
    return [e for e in data.get("traceEvents", data) if e.get("ph") == "X" and "dur" in e]


def busy_intervals(gpu: list[dict]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for e in sorted(gpu, key=lambda e: e["ts"]):
        a, b = e["ts"], e["ts"] + e["dur"]
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


class Stacks:
    """CPU ops per thread, to find the ops enclosing a moment (outermost first)."""

    def __init__(self, cpu: list[dict]):
        self.by_tid: dict = defaultdict(list)
        for e in cpu:
            self.by_tid[e["tid"]].append(e)
        for events in self.by_tid.values():
            events.sort(key=lambda e: e["ts"])
        self.starts = {tid: [e["ts"] for e in events] for tid, events in self.by_tid.items()}

    def enclosing(self, tid, ts: float) -> list[dict]:
        events, starts = self.by_tid.get(tid, []), self.starts.get(tid, [])
        i = bisect.bisect_right(starts, ts)
        found = [e for e in events[max(0, i - 4000):i] if e["ts"] + e["dur"] >= ts]
        return sorted(found, key=lambda e: -e["dur"])


def is_copy(name: str) -> bool:
    """A GPU activity that moves or fills memory (a copy or memset) rather than computing, by its name."""
    low = name.lower()
    return "memcpy" in low or "memset" in low


def compute_gaps(gpu: list[dict], count: int = 12) -> tuple[float, list[dict]]:
    """(idle µs between compute kernels in all, the `count` longest idle stretches): kernels only, copies and memsets
    left out, each stretch with its start (ms from the first kernel) and the kernels that end and begin it."""
    kernels = sorted((e for e in gpu if e.get("cat") == "kernel" and not is_copy(e["name"])), key=lambda e: e["ts"])
    if not kernels:
        return 0.0, []
    first, stretches, end, last = kernels[0]["ts"], [], None, None
    for e in kernels:
        if end is not None and e["ts"] > end:
            stretches.append({"at_ms": round((end - first) / 1e3, 3), "idle_us": round(e["ts"] - end, 1),
                              "after": last["name"][:70], "before": e["name"][:70]})
        if end is None or e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e
    longest = sorted(stretches, key=lambda g: -g["idle_us"])[:count]
    return sum(g["idle_us"] for g in stretches), longest


def label(stack: list[dict]) -> tuple[str, str]:
    names = [e["name"] for e in stack if not e["name"].startswith("ProfilerStep")]
    if not names:
        return "(no CPU op: Python between ops)", ""
    return names[0][:90], names[-1][:60]


def analyze(events: list[dict], min_gap_us: float = 5.0) -> dict:
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    cpu = [e for e in events if e.get("cat") in CPU_CATS]
    calls = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    runtime = {e["args"]["correlation"]: e for e in calls if "correlation" in e.get("args", {})}
    if not gpu:
        return {"error": "no GPU events in the trace"}
    stacks = Stacks(cpu)
    busy = busy_intervals(gpu)
    starts_at = defaultdict(list)
    for e in gpu:
        starts_at[e["ts"]].append(e)
    by_phase, by_call, waited, total_gap = defaultdict(float), defaultdict(float), 0.0, 0.0
    for (a0, b0), (a1, _) in zip(busy, busy[1:]):
        gap = a1 - b0
        if gap < min_gap_us:
            continue
        total_gap += gap
        ender = starts_at[a1][0]
        launch = runtime.get(ender.get("args", {}).get("correlation"))
        if launch is None:
            by_phase["(launch not in trace)"] += gap
            continue
        if launch["ts"] + launch["dur"] <= b0:
            waited += gap
            by_phase["(waited on another stream: " + ender["name"][:40] + ")"] += gap
            continue
        outer, inner = label(stacks.enclosing(launch["tid"], launch["ts"]))
        by_phase[outer] += gap
        by_call[f"{outer} > {inner}"] += gap
    span = busy[-1][1] - busy[0][0]
    syncs = defaultdict(lambda: [0, 0.0])
    for e in calls:
        if e["name"].startswith(SYNCS):
            outer, _ = label(stacks.enclosing(e["tid"], e["ts"]))
            syncs[f"{e['name']} in {outer}"][0] += 1
            syncs[f"{e['name']} in {outer}"][1] += e["dur"]
    idle, longest = compute_gaps(gpu)
    top = lambda d, n: {k: round(v / 1e3, 3) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]}  # noqa: E731
    return {"gpu_span_ms": round(span / 1e3, 3), "busy_ms": round(sum(b - a for a, b in busy) / 1e3, 3),
            "gaps_ms": round(total_gap / 1e3, 3), "waited_on_other_stream_ms": round(waited / 1e3, 3),
            "compute_gaps_ms": round(idle / 1e3, 3), "largest_compute_gaps": longest,
            "gaps_by_phase_ms": top(by_phase, 20), "gaps_by_call_ms": top(by_call, 25),
            "host_syncs": {k: {"count": n, "ms": round(t / 1e3, 3)}
                           for k, (n, t) in sorted(syncs.items(), key=lambda kv: -kv[1][1])[:15]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--min-gap-us", type=float, default=5.0)
    args = parser.parse_args()
    for path in args.traces:
        print(f"== {path}")
        print(json.dumps(analyze(load(path), args.min_gap_us), indent=1))


if __name__ == "__main__":
    main()
