"""GPU time by kernel in GPU-only traces (`bench/throughput.py --gpu-trace DIR`): each kernel's total ms and count
over the profiled step, and, given two traces, what changed between them, biggest first.

    python bench/kernel_totals.py DIR/w512-ours.json.gz                  # one step's kernels
    python bench/kernel_totals.py --compare BEFORE.json.gz AFTER.json.gz # the difference, kernel by kernel

Where two engines' GPU compute per token differ (bench/against_commit.py), this says which kernels account for it."""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from trace_gaps import GPU_CATS, load


def totals(path: Path) -> dict[str, tuple[float, int]]:
    """Kernel name -> (ms, count) over the trace's GPU events."""
    ms, count = defaultdict(float), defaultdict(int)
    for e in load(path):
        if e.get("cat") in GPU_CATS:
            ms[e["name"]] += e["dur"] / 1000
            count[e["name"]] += 1
    return {name: (ms[name], count[name]) for name in ms}


def show(path: Path, top: int) -> None:
    kernels = totals(path)
    print(f"== {path}: {sum(ms for ms, _ in kernels.values()):.2f} ms in "
          f"{sum(c for _, c in kernels.values())} GPU events")
    for name, (ms, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{ms:8.3f} ms {count:5d}x  {name[:120]}")


def compare(before: Path, after: Path, top: int) -> None:
    a, b = totals(before), totals(after)
    print(f"== {before} -> {after}: {sum(m for m, _ in a.values()):.2f} -> {sum(m for m, _ in b.values()):.2f} ms")
    rows = [(b.get(k, (0, 0))[0] - a.get(k, (0, 0))[0], k) for k in set(a) | set(b)]
    for delta, name in sorted(rows, key=lambda r: -abs(r[0]))[:top]:
        (ms_a, n_a), (ms_b, n_b) = a.get(name, (0.0, 0)), b.get(name, (0.0, 0))
        print(f"{delta:+8.3f} ms  {ms_a:8.3f} ms {n_a:5d}x -> {ms_b:8.3f} ms {n_b:5d}x  {name[:100]}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="*", type=Path)
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--top", type=int, default=45)
    args = parser.parse_args(argv)
    if args.compare:
        compare(*args.compare, args.top)
    for path in args.traces:
        show(path, args.top)


if __name__ == "__main__":
    main()
