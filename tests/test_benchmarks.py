"""nb_helpers.ui.benchmarks and plots.plot_benchmark: notebook 04 reads the committed GPU benchmark."""

import json

import pytest

from nb_helpers.ui.benchmarks import THROUGHPUT_JSON, benchmark_markdown, load_benchmark
from nb_helpers.ui.plots import plot_benchmark


def test_the_committed_benchmark_gives_each_workload_its_reference_and_ours():
    raw = json.loads(THROUGHPUT_JSON.read_text())
    bench = load_benchmark()
    assert [r.workload for r in bench.rows] == [w for w in raw["workloads"] for _ in ("reference", "ours")]
    for ref, ours in zip(bench.rows[::2], bench.rows[1::2]):
        runs = raw["workloads"][ours.workload]["runs"]
        assert (ref.recipe, ours.recipe, ref.ratio) == ("reference", "ours", 1.0)
        assert ours.ratio == pytest.approx(runs["ours"]["tokens_per_s"] / runs["reference"]["tokens_per_s"])
        assert ours.peak_device_gib == runs["ours"]["peak_device_gib"]
    table = benchmark_markdown(bench)
    assert f"| w512 | ours | 8 × 1 | {raw['workloads']['w512']['runs']['ours']['tokens_per_s']:,.0f} |" in table
    assert raw["measured_at_commit"]["shipped"].split(" ")[0] in table  # each workload names its own call


def test_a_workload_without_both_runs_is_left_out(tmp_path):
    run = dict(micro_batch=1, accum=8, tokens_per_s=100.0, peak_device_gib=1.5)
    data = {"gpu": "X", "workloads": {"w512": {"runs": {"reference": run, "ours": {**run, "tokens_per_s": 300.0}}},
                                      "w2048": {"runs": {"reference": run, "ours": {**run, "tokens_per_s": None}}}}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    bench = load_benchmark(path)
    assert [(r.workload, r.recipe, r.ratio) for r in bench.rows] == [("w512", "reference", 1.0), ("w512", "ours", 3.0)]
    fig = plot_benchmark(bench)
    speed, memory = fig.axes
    assert [b.get_height() for b in speed.patches] == [100.0, 300.0]
    assert memory.lines[0].get_ydata()[0] == 4.0  # the budget line
    assert "w512 3.0x" in fig.alt


def test_no_file_and_a_bad_file_are_told_apart(tmp_path):
    assert load_benchmark(tmp_path / "missing.json") is None
    bad = tmp_path / "bad.json"
    bad.write_text('{"gpu": "X"}')
    with pytest.raises(ValueError, match="bad.json: no 'workloads'.*bench/throughput.py"):
        load_benchmark(bad)


def test_trace_gaps_blames_each_gap_on_the_op_that_launched_its_end(tmp_path):
    """bench/trace_gaps.py on a made-up trace: one gap the host caused inside the optimizer (its launch came late),
    one the GPU spent waiting on another stream (its launch came before the gap began)."""
    import gzip
    import sys

    from nb_helpers.config import PROJECT_ROOT

    sys.path.insert(0, str(PROJECT_ROOT / "bench"))
    from trace_gaps import analyze, load

    def op(name, ts, dur, tid=1, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}

    def launch(corr, ts, tid=1):
        return {**op("cudaLaunchKernel", ts, 2, tid, "cuda_runtime"), "args": {"correlation": corr}}

    def kernel(name, corr, ts, dur):
        return {**op(name, ts, dur, 7, "kernel"), "args": {"correlation": corr}}

    events = [
        op("aten::mm", 0, 10), launch(1, 1), kernel("gemm", 1, 5, 95),                   # busy 5-100
        op("Optimizer.step#AdamW8bit.step", 100, 400), op("aten::copy_", 380, 20),
        launch(2, 385), kernel("update", 2, 390, 10),                                   # gap 100-390: optimizer
        launch(3, 410), kernel("memcpy HtoD", 3, 420, 30),                              # gap 400-420: host late
        op("aten::mm", 600, 10), launch(4, 440), kernel("gemm2", 4, 700, 50),           # gap 450-700: waited
        op("cudaStreamSynchronize", 800, 40, cat="cuda_runtime"),
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    report = analyze(load(path))
    assert report["busy_ms"] == pytest.approx((95 + 10 + 30 + 50) / 1e3)
    assert report["gaps_ms"] == pytest.approx((290 + 20 + 250) / 1e3)
    assert report["waited_on_other_stream_ms"] == pytest.approx(0.25)
    assert report["gaps_by_phase_ms"]["Optimizer.step#AdamW8bit.step"] == pytest.approx(0.31)
    assert report["gaps_by_call_ms"] == {"Optimizer.step#AdamW8bit.step > aten::copy_": pytest.approx(0.29),
                                         "Optimizer.step#AdamW8bit.step > Optimizer.step#AdamW8bit.step":
                                             pytest.approx(0.02)}
    assert report["host_syncs"] == {"cudaStreamSynchronize in (no CPU op: Python between ops)": {"count": 1,
                                                                                                 "ms": 0.04}}


def test_busy_time_is_the_union_of_intervals_and_compute_leaves_the_copies_out():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from throughput import union_ns

    kernels = [(0, 10, False), (5, 20, False), (30, 40, False)]
    copies = [(15, 35, True)]
    assert union_ns(kernels) == 30  # 0-20 and 30-40
    assert union_ns(kernels + copies) == 40  # the copy fills 20-30
    assert union_ns([]) == 0
