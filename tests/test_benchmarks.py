"""nb_helpers.benchmarks and plots.plot_benchmark: notebook 04 reads the committed GPU benchmark."""

import json

import pytest

from nb_helpers.benchmarks import THROUGHPUT_JSON, benchmark_markdown, load_benchmark
from nb_helpers.plots import plot_benchmark


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
