"""nb_helpers.ui.benchmarks and plots.plot_benchmark: notebook 04 reads the committed GPU benchmark. And the results
themselves: one file per run under bench/results/runs/ (bench/run_file.py), and what learners read
(bench/results/latest.json, bench/RESULTS.md) exactly what bench/summarize.py generates from them, naming machines
and dates, never our bookkeeping."""

import json
import re
import sys

import pytest

from nb_helpers.config import PROJECT_ROOT
from nb_helpers.ui.benchmarks import LATEST_JSON, benchmark_markdown, load_benchmark
from nb_helpers.ui.plots import plot_benchmark

sys.path.insert(0, str(PROJECT_ROOT / "bench"))
from run_file import load_runs  # noqa: E402
RESULTS = PROJECT_ROOT / "bench" / "results"
RUN_NAME = re.compile(r"^(\d{4}-\d\d-\d\d)-([a-z0-9]+(?:-[a-z0-9]+)*)-([0-9a-z]+)\.json$")
BOOKKEEPING_KEY = re.compile(r"^(spread|earlier)$|(?<![a-z])issue[\s_-]*\d+|(?<![a-z])calls?[\s_-]*\d+", re.I)
BOOKKEEPING_TEXT = [re.compile(r"\b(device\s+)?calls?\s*\d+", re.I), re.compile(r"\bissues?\s*#?\d+", re.I),
                    re.compile(r"\b(device\s+)?calls?\b", re.I),  # "two device calls": our word, not a reader's
                    re.compile(r"(?<![0-9A-Za-z])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![0-9A-Za-z])")]


def latest() -> dict:
    return json.loads(LATEST_JSON.read_text(encoding="utf-8"))


def run_files() -> list:
    return sorted((RESULTS / "runs").glob("*.json"))


def test_the_committed_benchmark_gives_each_workload_its_reference_and_ours():
    raw = latest()["throughput"]["workloads"]
    bench = load_benchmark()
    assert set(raw) == {"w512", "w2048", "shipped"}
    assert [r.workload for r in bench.rows] == [w for w in raw for _ in ("reference", "ours")]
    for ref, ours in zip(bench.rows[::2], bench.rows[1::2]):
        entry = raw[ours.workload]
        assert (ref.recipe, ours.recipe, ref.ratio) == ("reference", "ours", 1.0)
        assert ours.ratio == pytest.approx(entry["ours"]["tokens_per_s"] / entry["reference"]["tokens_per_s"])
        assert ours.ratio == pytest.approx(entry["ratio"])
        assert ours.peak_device_gib == entry["ours"]["peak_device_gib"]
    table = benchmark_markdown(bench)
    assert f"| w512 | ours | 8 × 1 | {raw['w512']['ours']['tokens_per_s']:,.0f} |" in table
    assert f"| {raw['shipped']['machine']}, {raw['shipped']['date']} |" in table  # each workload names its own run
    assert raw["shipped"]["command"] in table


def test_each_headline_figure_is_its_run_files_own():
    """latest.json's reference and ours per workload are the figures of the run file it names, both in that run, and
    no newer run measured both."""
    for workload, entry in latest()["throughput"]["workloads"].items():
        run = json.loads((PROJECT_ROOT / entry["run_file"]).read_text())
        runs = run["results"]["workloads"][workload]["runs"]
        for name in ("reference", "ours"):
            assert runs[name]["tokens_per_s"] == entry[name]["tokens_per_s"]
            assert runs[name]["peak_device_gib"] == entry[name]["peak_device_gib"]
        assert (run["date"], run["machine"]["gpu"]) == (entry["date"], entry["machine"])
        ordered = [r["file"] for r in load_runs("throughput")]
        for other in load_runs("throughput")[ordered.index(entry["run_file"]) + 1:]:
            pair = ((other["results"].get("workloads") or {}).get(workload) or {}).get("runs") or {}
            assert not ((pair.get("reference") or {}).get("tokens_per_s") and (pair.get("ours") or {}).get(
                "tokens_per_s")), f"{other['file']} is newer and measured both at {workload}"


def test_a_run_file_loads_as_a_benchmark():
    """bench/throughput.py's run file (or its --out) reads as it is: notebook 04 can show a learner's own run."""
    path = PROJECT_ROOT / latest()["plain_vs_reference"]["w512"]["run_file"]
    bench = load_benchmark(path)
    assert [(r.workload, r.recipe) for r in bench.rows] == [("w512", "reference"), ("w512", "ours")]
    assert bench.gpu == "NVIDIA H200" and bench.measured_at["w512"] == f"NVIDIA H200, {bench.date}"
    assert "--out" not in bench.commands["w512"] and bench.commands["w512"].startswith("python bench/throughput.py")


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


def test_the_readme_quotes_the_newest_figures():
    """The README's speed table and its planner, time-model and several-GPU figures are latest.json's."""
    readme = (PROJECT_ROOT / "README.md").read_text(encoding="utf-8")
    data = latest()
    for workload, e in data["throughput"]["workloads"].items():
        gpu = e["machine"].split()[1]  # "NVIDIA H100 80GB HBM3" -> "H100": each row names its GPU
        row = next(line for line in readme.splitlines() if line.startswith(f"| {e['label']}, {gpu} |"))
        assert f"{e['reference']['tokens_per_s']:,.0f}" in row and f"{e['ours']['tokens_per_s']:,.0f}" in row, row
        assert f"**{e['ratio']:.1f}×**" in row, (workload, row)
        assert e["date"] in readme[readme.index("**On a GPU.**"):readme.index(row)], (workload, "its date")
    c = data["planner"]["planned_from_cpu"]
    assert f"the {c['points']} committed H200 points" in readme
    assert f"within {c['worst_abs_error_pct']:.1f}% at worst" in readme
    s = data["step_time"]
    assert f"within 15% at {s['held_out']['step_error']['within_15pct']} of {s['held_out_points']} held-out" in readme
    assert all(f"{m['scaling_2_gpus']:.2f}×" in readme for m in data["multi_gpu"].values())


def test_latest_json_and_results_md_are_what_summarize_writes():
    """Neither is edited by hand: `make results` (bench/summarize.py) writes both from the committed run files."""
    import summarize

    latest_json, results_md = summarize.render()
    assert LATEST_JSON.read_text(encoding="utf-8") == latest_json, "bench/results/latest.json: run `make results`"
    assert (PROJECT_ROOT / "bench" / "RESULTS.md").read_text(encoding="utf-8") == results_md, \
        "bench/RESULTS.md: run `make results`"


def test_every_run_file_says_what_ran_where_and_when():
    files = run_files()
    assert len(files) >= 70
    for path in files:
        data = json.loads(path.read_text())
        name = RUN_NAME.match(path.name)
        assert name, f"{path.name}: not <date>-<what>-<id>.json"
        assert (data["format"], data["date"], data["kind"]) == (1, name.group(1), name.group(2)), path.name
        assert data["command"] and isinstance(data["results"], dict) and "commit" in data, path.name
        assert data.get("machine") or data.get("migrated_from"), path.name  # a new run always records its machine


def test_no_results_file_holds_bookkeeping_keys():
    """bench/results (raw output aside) holds runs, not a history keyed by our device calls or issues."""
    def keys(node, path):
        if isinstance(node, dict):
            for key, value in node.items():
                yield f"{path}/{key}", key
                yield from keys(value, f"{path}/{key}")
        elif isinstance(node, list):
            for value in node:
                yield from keys(value, path)

    files = [p for p in RESULTS.rglob("*.json") if "raw" not in p.relative_to(RESULTS).parts]
    assert LATEST_JSON in files and len(files) > 70
    bad = [f"{p.relative_to(RESULTS)}: {where}" for p in files
           for where, key in keys(json.loads(p.read_text()), "") if BOOKKEEPING_KEY.search(key)]
    assert not bad, bad[:10]
    assert [p.name for p in RESULTS.glob("*.json")] == ["latest.json"], "an aggregate: write run files instead"
    assert BOOKKEEPING_KEY.search("call31 dca9720") and BOOKKEEPING_KEY.search("issue27")
    assert BOOKKEEPING_KEY.search("spread") and not BOOKKEEPING_KEY.search("recalls")


def test_what_learners_read_names_machines_dates_and_commands_not_our_bookkeeping():
    def strings(node):
        if isinstance(node, dict):
            for value in node.values():
                yield from strings(value)
        elif isinstance(node, list):
            for value in node:
                yield from strings(value)
        elif isinstance(node, str):
            yield node

    text = (PROJECT_ROOT / "bench" / "RESULTS.md").read_text(encoding="utf-8")
    for where, value in [("RESULTS.md", text), *(("latest.json", s) for s in strings(latest()))]:
        for pattern in BOOKKEEPING_TEXT:
            assert not pattern.search(value), f"{where}: {pattern.search(value).group(0)!r} in {value[:120]!r}"
    for section in text.split("\n## ")[1:]:  # every table cites a run: its machine, date and command
        cited = re.findall(r"^\[\d+\] (.+), (\d{4}-\d\d-\d\d): `(python|NB_CI)", section, re.M)
        assert cited and "|---" in section, section[:80]
    assert not BOOKKEEPING_TEXT[3].search("ours-bfloat16-gtx1650 2026-12-03 580.159.04")
    assert BOOKKEEPING_TEXT[3].search("at 59b4ead") and BOOKKEEPING_TEXT[0].search("device call 26")


def test_a_run_file_records_the_run_and_rewrites_itself(tmp_path, monkeypatch):
    import os

    from run_file import ENVIRONMENT, RunFile

    for key in [k for k in os.environ if k.startswith("NB_") or k in ENVIRONMENT]:  # the machine's own (the GPU suite
        monkeypatch.delenv(key)  # runs with NB_OFFLINE_DEVICE and NB_CACHE_DIR set): only what this test sets counts
    monkeypatch.setenv("NB_FASTPATH", "graphs=0")
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    run = RunFile("cpu", out_dir=tmp_path, device="cpu", argv=["bench/cpu_bench.py", "--steps", "2"])
    run.write({"rows": [1]})
    path = run.write({"rows": [1, 2]})  # a run rewrites its own file as it goes
    assert [p.name for p in tmp_path.iterdir()] == [path.name] and RUN_NAME.match(path.name)
    data = json.loads(path.read_text())
    assert data["results"] == {"rows": [1, 2]} and data["kind"] == "cpu" and data["commit"] == "abc1234"
    assert data["command"] == "python bench/cpu_bench.py --steps 2"
    assert data["environment"] == {"NB_FASTPATH": "graphs=0"} and data["machine"]["cores"]
    assert data["versions"]["torch"] and data["started"].startswith(data["date"])
    exact = RunFile("cpu", out=tmp_path / "mine.json", device="cpu").write({})
    assert exact == tmp_path / "mine.json"
    migrated = {**data, "started": None}
    (tmp_path / f"{data['date']}-cpu-h01.json").write_text(json.dumps(migrated))
    order = [r["file"].rsplit("/", 1)[-1] for r in load_runs("cpu", tmp_path)]
    assert order[0] == f"{data['date']}-cpu-h01.json"  # a migrated file (no start time) before a new one that day


def test_a_run_notes_what_else_holds_the_gpu_as_it_starts(tmp_path, monkeypatch):
    """host_load() lists other processes' GPU memory from nvidia-smi (this process left out: a parent that made
    its model on the card is not a stranger) and the load average; no nvidia-smi, no processes."""
    import os

    from run_file import host_load

    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '4242, GPU-a, 1536'\necho '{os.getpid()}, GPU-a, 600'\necho '77, GPU-a, [N/A]'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    load = host_load()
    assert load["gpu_processes"] == [[4242, 1536]] and load["load_1min"] >= 0 and load["cores"] == os.cpu_count()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert host_load()["gpu_processes"] == []


def test_trace_gaps_blames_each_gap_on_the_op_that_launched_its_end(tmp_path):
    """bench/trace_gaps.py on a made-up trace: one gap the host caused inside the optimizer (its launch came late),
    one the GPU spent waiting on another stream (its launch came before the gap began)."""
    import gzip

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
    # the compute kernels alone (the HtoD copy left out): idle 100-390 and 400-700, the longest first
    assert report["compute_gaps_ms"] == pytest.approx((290 + 300) / 1e3)
    assert [(g["at_ms"], g["idle_us"], g["after"], g["before"]) for g in report["largest_compute_gaps"]] == [
        (0.395, 300.0, "update", "gemm2"), (0.095, 290.0, "gemm", "update")]


def test_busy_time_is_the_union_of_intervals_and_compute_leaves_the_copies_out():
    from throughput import union_ns

    kernels = [(0, 10, False), (5, 20, False), (30, 40, False)]
    copies = [(15, 35, True)]
    assert union_ns(kernels) == 30  # 0-20 and 30-40
    assert union_ns(kernels + copies) == 40  # the copy fills 20-30
    assert union_ns([]) == 0


def test_the_gpus_lag_behind_the_host_is_counted_from_each_steps_beginning():
    """bench/throughput.py's host phases on made-up clocks: a forward the host queues slower than the GPU runs (the
    GPU keeps up: no lag), a backward the GPU runs slower (the host gets ahead), and a synchronize at the step's end.
    Each clock has its own origin; warm-up steps and points before the first step are left out."""
    from throughput import gpu_lags

    def step(host0, gpu0, gpu_backward_ms):
        return [("step_begin", host0, gpu0),
                ("forward_done", host0 + 80, gpu0 + 80.5),  # host-bound: the GPU half a millisecond behind
                ("backward_done", host0 + 180, gpu0 + 80.5 + gpu_backward_ms),
                ("step_end", host0 + 80.5 + gpu_backward_ms, gpu0 + 80.5 + gpu_backward_ms)]  # the synchronize

    marks = [("fetched", -5.0, 1000.0)]  # before any step: no anchor
    host, gpu = 0.0, 1000.0
    for backward in (500, 150, 140, 160):  # the first is the warm-up
        marks += step(host, gpu, backward)
        host, gpu = host + 300, gpu + 300
    report = gpu_lags(marks, skip_steps=1)
    assert set(report) == {"forward_done", "backward_done", "step_end", "per_step"}
    assert report["forward_done"] == pytest.approx(0.5)
    assert report["per_step"]["backward_done"] == [pytest.approx(x) for x in (50.5, 40.5, 60.5)]
    assert report["backward_done"] == pytest.approx(50.5)  # the median
    assert report["step_end"] == pytest.approx(0.0)


def test_the_forward_graphs_candidate_skips_exactly_the_backwards_capture(monkeypatch):
    """bench/throughput.py's forward-graphs run replaces the one name fast.graphed_layers' backward calls to capture a
    layer's backward graph, so that the layer falls back to its eager recompute and backward. Were that name renamed
    or inlined, the run would graph both halves and measure nothing new: the check names it, and the run reports how
    many captures it skipped."""
    import throughput

    from nb_helpers.fast import graphed_layers

    monkeypatch.setattr(graphed_layers, "_capture_backward", graphed_layers._capture_backward)  # put back afterwards
    assert "_capture_backward" in graphed_layers._GraphedCheckpoint.backward.__code__.co_names
    skipped = throughput.forward_graphs_only()
    assert graphed_layers._capture_backward(None, None, None, None, None) is None
    graphed_layers._capture_backward(None, None, None, None, None)
    assert skipped == [2]
    candidate = [r for r in throughput.lever_runs(["w512", "w2048"], steps=13) if r.get("forward_graphs_only")]
    assert [(r["workload"], r["batch"], r["accum"], r["cuda_graphs"], r["offload"], r["phases"]) for r in candidate] \
        == [("w2048", 8, 1, True, True, True)]  # auto-fit's choice there, with the host's phases beside it


def test_dpo_points_are_checked_against_the_planner_and_compared_within_one_run(tmp_path):
    """bench/dpo.py's run files: each point's planner error counted against ±10%, the newest measurement of a point
    kept, and a speed ratio only between runs of the same file."""
    import summarize

    def point(run, seq, tokens_per_s, peak, planned, batch=1):
        return {"shape": "tinyllama-1.1b", "seq": seq, "run": run, "micro_batch": batch, "accum": 8 // batch,
                "gc": batch == 1, "returncode": 0, "median_step_s": 1.0, "tokens_per_s": tokens_per_s,
                "peak_device_gib": peak, "predicted_here_gib": planned, "planner_error": planned / peak - 1,
                "predicted_gtx1650_gib": 3.0, "gtx1650_budget_gib": 3.46}

    def write(name, points):
        (tmp_path / name).write_text(json.dumps({"format": 1, "kind": "dpo", "date": name[:10], "command":
                                                 "python bench/dpo.py", "commit": "x", "machine": {"gpu": "G"},
                                                 "results": {"points": points}}))

    write("2026-12-01-dpo-a.json", [point("ours", 512, 100.0, 2.0, 3.0)])  # superseded by the newer run below
    write("2026-12-02-dpo-b.json", [point("plain", 512, 100.0, 2.0, 2.1), point("ours", 512, 150.0, 2.2, 2.3),
                                    point("ours-fit", 512, 400.0, 3.0, 3.5, batch=4),
                                    point("ours", 1024, 90.0, 2.5, 2.6)])
    d = summarize.latest(tmp_path)["dpo"]
    assert [(p["seq"], p["run"]) for p in d["points"]] == [(512, "ours"), (512, "ours-fit"), (512, "plain"),
                                                          (1024, "ours")]
    assert (d["within_10_percent"], d["validated"]) == (3, 4)  # ours-fit planned 3.5 against 3.0: +17%
    (speed,) = d["speed"]
    assert speed["seq"] == 512 and speed["ours-fit"]["speedup"] == 4.0 and speed["ours"]["speedup"] == 1.5
    text = summarize.markdown(summarize.latest(tmp_path))
    assert "3 of 4 points within ±10%" in text and "400, 3.00 (4.00×)" in text


def test_a_course_run_that_stopped_before_make_run_is_summarized_not_fatal(tmp_path):
    """bench/course_time.py writes its run file after each step: one whose make setup failed (or a course still
    running) has no make run yet. The summary shows what ran and "–" for the rest instead of failing."""
    import summarize

    (tmp_path / "2026-12-01-course-a.json").write_text(json.dumps({
        "format": 1, "kind": "course", "date": "2026-12-01", "command": "python bench/course_time.py --test",
        "commit": "x", "machine": {"cpu": "C"}, "results": {"clone_of": "x", "setup_s": 12.0, "setup_exit": 2}}))
    text = summarize.markdown(summarize.latest(tmp_path))
    (row,) = [line for line in text.splitlines() if line.startswith("| C")]
    assert "| 12 s (exit 2) | – |" in row and row.count("| – |") >= 2


def test_a_lever_earns_its_place_by_a_bracketed_step_or_by_compute(tmp_path):
    """bench/summarize.py's pruning verdict: a step gain counts only beyond our default's own spread between the runs
    that bracket it (so not where our default ran once, a cut call); a compute gain of 3% counts on its own."""
    import summarize

    def run(step, compute):
        return {"recipe": "ours", "median_step_s": step, "tokens_per_s": 1.0, "peak_device_gib": 3.0,
                "busy": {"compute_us_per_token": compute}}

    def write(name, runs):
        (tmp_path / name).write_text(json.dumps({
            "format": 1, "kind": "lever-gains", "date": name[:10], "command": "python bench/throughput.py --gains x",
            "commit": "x", "machine": {"gpu": "G"},
            "results": {"workloads": {"w512": {"seq": 512, "effective_batch": 8, "runs": runs}}}}))

    write("2026-12-01-lever-gains-a.json", {  # bracketed: ours 1.00 and 1.01 (1% spread)
        "ours": run(1.00, 10.0), "no-stepper": run(1.05, 10.0), "no-idle": run(1.005, 10.1),
        "no-computer": run(0.95, 10.4), "ours-again": run(1.01, 10.0)})
    write("2026-12-02-lever-gains-b.json", {  # cut: ours ran once, so its 5% step gain has no bracket
        "ours": run(1.00, 10.0), "no-lonely": run(1.05, 10.1)})
    levers = summarize.latest(tmp_path)["lever_gains"]["levers"]
    verdict = {name: entry["earns_its_place"] for name, entry in levers.items()}
    assert verdict == {"stepper": True, "idle": False, "computer": True, "lonely": False}
    assert levers["lonely"]["workloads"]["w512"]["step_noise"] is None
    assert levers["stepper"]["workloads"]["w512"]["step_noise"] == 0.01
    assert "ours ran once" in summarize.markdown(summarize.latest(tmp_path))


def test_levers_takes_every_lever_out_once_where_it_runs_and_each_run_parses():
    """--levers is built from fast.options.LEVERS (taking each out as --gains does): a lever added to the registry is
    measured without editing the script, and every run's NB_FASTPATH is one the package accepts (a typo would fail on
    the device)."""
    from throughput import ONLY_AT, gain_runs, lever_runs

    from nb_helpers.config import fastpath_problems
    from nb_helpers.fast.options import LEVERS

    workloads = ["w512", "w2048", "shipped"]
    runs = lever_runs(workloads, steps=13)
    keys = [(r["workload"], r["name"]) for r in runs]
    assert len(keys) == len(set(keys)), "two runs of one workload share a name: the second would overwrite the first"
    assert {r["workload"] for r in runs} <= set(workloads)
    for lever in LEVERS:
        taken_out = {w for w, name in keys if name == f"no-{lever.replace('_', '-')}"}
        assert taken_out == set(ONLY_AT.get(lever, workloads)), lever
    assert not [(r["name"], r["fast"]) for r in runs if r.get("fast") and fastpath_problems(r["fast"])]
    assert lever_runs(["w512"], steps=13) == [r for r in runs if r["workload"] == "w512"]
    gains = gain_runs(["graphs"], ["w512", "w2048"], steps=13)  # graphs run at 8 x 512 only: its one run is there
    assert [(r["workload"], r["name"]) for r in gains] == [("w512", "ours"), ("w2048", "ours"), ("w512", "no-graphs"),
                                                           ("w512", "ours-again"), ("w2048", "ours-again")]


def test_the_options_plan_the_runs_they_name_in_order():
    """What one device call runs, read from its options on the CPU: the headline is the reference beside our default
    at each workload; --gains --with-reference puts the reference first, then the pruning measurement."""
    from throughput import arguments, planned_runs

    headline = planned_runs(arguments(["--workloads", "w2048,w512"]))
    names = [(r["workload"], r["name"]) for r in headline]
    assert names[:2] == [("w2048", "reference"), ("w2048", "ours")] and ("w512", "ours") in names
    assert all(r["profile"] for r in headline if r["name"] in ("reference", "ours"))  # GPU compute per token
    gains = planned_runs(arguments(["--workloads", "w512,w2048", "--gains", "dead_tail", "--with-reference"]))
    assert [(r["workload"], r["name"]) for r in gains] == [
        ("w512", "reference"), ("w2048", "reference"), ("w512", "ours"), ("w2048", "ours"), ("w512", "no-dead-tail"),
        ("w2048", "no-dead-tail"), ("w512", "ours-again"), ("w2048", "ours-again")]
    turing = planned_runs(arguments(["--workloads", "shipped,w512", "--gains", "graphs", "--turing"]))
    assert [r["name"] for r in turing if r.get("card")] == ["ours-bfloat16-gtx1650", "ours-float16-gtx1650"]


def test_against_commit_reads_both_layouts_and_compares_medians():
    """bench/against_commit.py: the earlier engine's throughput.json (workloads at the top) and this one's run file
    (under results) read alike; the ratios are of the medians over rounds, and a failed run is left out."""
    from against_commit import compare, ours_figures

    def ours(tok_s, us, code=0):
        return {"returncode": code, "tokens_per_s": tok_s, "median_step_s": 4096 / tok_s, "micro_batch": 8,
                "peak_device_gib": 3.7, "busy": {"compute_us_per_token": us, "us_per_token": us + 0.1}}

    earlier = {"workloads": {"w512": {"ours": ours(60_000, 13.0)}, "w2048": {"ours": ours(70_000, 12.0, code=1)}}}
    now = {"results": {"workloads": {"w512": {"runs": {"ours": ours(66_000, 12.0)}},
                                     "w2048": {"ours": ours(72_000, 11.0)}}}}
    assert set(ours_figures(earlier)) == {"w512"}  # the failed 8 x 2048 run gives no figures
    assert ours_figures(now)["w512"]["compute_us_per_token"] == 12.0
    rounds = [{"baseline": ours_figures(earlier), "now": ours_figures(now)},
              {"baseline": {"w512": {**ours_figures(earlier)["w512"], "tokens_per_s": 62_000}},
               "now": {"w512": {**ours_figures(now)["w512"], "tokens_per_s": 64_000}}}]
    summary = compare(rounds)
    assert summary["w512"]["baseline"]["tokens_per_s"] == 61_000 and summary["w512"]["now"]["tokens_per_s"] == 65_000
    assert summary["w512"]["now_over_baseline"]["tokens_per_s"] == pytest.approx(65 / 61)
    assert summary["w512"]["now_over_baseline"]["compute_us_per_token"] == pytest.approx(12 / 13)
    assert summary["w2048"]["baseline"]["rounds"] == 0 and summary["w2048"]["now_over_baseline"]["tokens_per_s"] is None
    reference = ours_figures({"results": {"workloads": {"w512": {"runs": {"reference": ours(2_000, 48.0)}}}}},
                             "reference")  # --with-reference: the recipe's run, read as ours is
    beside = compare(rounds, reference)
    assert beside["w512"]["reference"] == {"tokens_per_s": 2_000}
    assert beside["w512"]["over_reference"] == {"baseline": pytest.approx(30.5), "now": pytest.approx(32.5)}
    assert "over_reference" not in beside["w2048"] and "over_reference" not in summary["w512"]


def test_the_engine_against_a_baseline_is_summarized_by_the_baselines_date(tmp_path):
    """Every bench/against_commit.py run becomes rows of one table, oldest first and never pooled (each run is its
    own host), naming the earlier engine by its date, never its commit; a workload where one engine failed shows its
    figure and "–" for the ratio."""
    import summarize
    from against_commit import compare

    def figures(tok_s, us):
        return {"tokens_per_s": tok_s, "compute_us_per_token": us}

    def write(name, date, rounds, reference=None):
        (tmp_path / name).write_text(json.dumps({
            "format": 1, "kind": "against-commit", "date": date, "command": "python bench/against_commit.py",
            "commit": "x", "machine": {"gpu": "NVIDIA H100", "gpu_count": 1},
            "results": {"baseline": {"commit": "22d453c", "date": "2026-12-03"}, "rounds": rounds,
                        "summary": compare(rounds, reference)}}))

    write("2026-12-09-against-commit-b.json", "2026-12-09",
          [{"baseline": {"w512": figures(50_000, 12.5)}, "now": {"w512": figures(55_000, 12.5)}}] * 2,
          reference={"w512": {"tokens_per_s": 2_000}})
    write("2026-12-08-against-commit-a.json", "2026-12-08",
          [{"baseline": {"w512": figures(60_000, 12.6), "w2048": figures(70_000, 11.9)},
            "now": {"w512": figures(63_000, 12.0)}}])
    data = summarize.latest(tmp_path)
    assert [run["date"] for run in data["against_baseline"]] == ["2026-12-08", "2026-12-09"]
    assert data["against_baseline"][0]["baseline_date"] == "2026-12-03"
    text = summarize.markdown(data)
    assert "the engine of 2026-12-03" in text and "22d453c" not in text + json.dumps(data)
    older = "| 8 × 512 tokens | 60,000, 63,000 (1.050) | 12.60, 12.00 (0.952) | – | 1 | NVIDIA H100, 2026-12-08 [1] |"
    newer = ("| 8 × 512 tokens | 50,000, 55,000 (1.100) | 12.50, 12.50 (1.000) | 25.0×, 27.5× | 2 | NVIDIA H100, "
             "2026-12-09 [2] |")  # the run with the reference: each engine's median over it
    assert older in text and newer in text and text.index(older) < text.index(newer)
    assert "| 8 × 2048 tokens | 70,000, – (–) | 11.90, – (–) | – | 1 |" in text


def test_against_commit_extracts_a_baseline_that_names_itself(tmp_path):
    """--extract writes the commit's package and bench scripts without its results, and BASELINE.json names the
    commit and its date; a tree without one is refused with the command that makes it."""
    import subprocess

    from against_commit import extract, read_baseline

    head = subprocess.run(["git", "-C", str(PROJECT_ROOT), "log", "-1", "--format=%h %cs"], capture_output=True,
                          text=True)
    if head.returncode != 0:
        pytest.skip("no git history here")
    tree = tmp_path / "baseline"
    assert extract("HEAD", tree) == dict(zip(("commit", "date"), head.stdout.split()))
    assert read_baseline(tree) == dict(zip(("commit", "date"), head.stdout.split()))
    assert (tree / "bench" / "throughput.py").exists() and (tree / "nb_helpers" / "__init__.py").exists()
    assert not (tree / "bench" / "results").exists()
    with pytest.raises(SystemExit, match="--extract COMMIT"):
        read_baseline(tmp_path)


def test_against_commit_swaps_the_engines_order_each_round(tmp_path, monkeypatch):
    """Each round runs both engines, the baseline first in the first round and second in the next (drift over a call
    weighs on both); the reference, asked for, runs once before them; the run file keeps that order."""
    import against_commit

    tree = tmp_path / "baseline"
    tree.mkdir()
    (tree / "BASELINE.json").write_text(json.dumps({"commit": "abc1234", "date": "2026-12-03"}))
    order = []

    def run_engine(where, commit, args, out_json, recipe="ours"):
        order.append("reference" if recipe == "reference" else "baseline" if where == tree.resolve() else "now")
        return {"returncode": 0, "wall_s": 1.0, "figures": {"w512": {"tokens_per_s": 1000.0 * len(order),
                                                                    "compute_us_per_token": 12.0}}}

    monkeypatch.setattr(against_commit, "run_engine", run_engine)
    against_commit.main(["--tree", str(tree), "--rounds", "3", "--with-reference", "--out-dir", str(tmp_path)])
    assert order == ["reference", "baseline", "now", "now", "baseline", "baseline", "now"]
    saved = json.loads(next(tmp_path.glob("*against-commit*.json")).read_text())["results"]
    assert [(r["round"], r["engine"]) for r in saved["runs"]] == [
        (0, "reference"), (1, "baseline"), (1, "now"), (2, "now"), (2, "baseline"), (3, "baseline"), (3, "now")]
    assert saved["summary"]["w512"]["baseline"]["tokens_per_s"] == 5000.0  # the median of 2,000, 5,000 and 6,000


def test_kernel_totals_sums_each_kernel_and_says_what_changed(tmp_path, capsys):
    """bench/kernel_totals.py on two made-up GPU-only traces: host ops are left out, each kernel's time and count are
    summed, and the comparison lists the biggest change first, with a kernel that only one side ran."""
    from kernel_totals import compare, totals

    def trace(name, events):
        path = tmp_path / name
        path.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": cat, "name": kernel, "dur": dur}
                                                    for cat, kernel, dur in events]}))
        return path

    before = trace("a.json", [("kernel", "gemm", 500), ("kernel", "gemm", 700), ("kernel", "dequant", 100),
                              ("cpu_op", "aten::mm", 9000)])
    after = trace("b.json", [("kernel", "gemm", 1200), ("kernel", "add", 400), ("gpu_memcpy", "Memcpy DtoD", 50)])
    assert totals(before) == {"gemm": (1.2, 2), "dequant": (0.1, 1)}
    compare(before, after, top=10)
    lines = capsys.readouterr().out.splitlines()
    assert "1.30 -> 1.65 ms" in lines[0]
    assert lines[1].split()[0] == "+0.400" and lines[1].endswith("add")
    assert lines[2].split()[0] == "-0.100" and lines[2].endswith("dequant")
    assert not any(line.endswith("gemm") and not line.lstrip().startswith("+0.000") for line in lines[1:])


def test_ours_copies_are_ranged_over_runs_and_the_shown_run_named(tmp_path):
    """Where our path copies checkpoints to CPU RAM, the speed section gives the copies' range over every run and
    how much of them had no compute beside them (busy minus compute), with the table's own run; a workload without
    copies (under 10 ms) gets no such line."""
    import summarize

    def run(name, date, copy_s, busy_s, compute_s):
        ours = {"tokens_per_s": 60_000, "median_step_s": 0.27, "micro_batch": 8, "accum": 1,
                "busy": {"copy_s": copy_s, "busy_s": busy_s, "compute_busy_s": compute_s}}
        small = {**ours, "busy": {"copy_s": 0.002, "busy_s": 0.05, "compute_busy_s": 0.05}}
        reference = {"tokens_per_s": 6_000, "median_step_s": 2.6, "micro_batch": 1, "accum": 8}
        (tmp_path / name).write_text(json.dumps({
            "format": 1, "kind": "throughput", "date": date, "command": "python bench/throughput.py",
            "commit": "x", "machine": {"gpu": "NVIDIA H100", "gpu_count": 1},
            "results": {"workloads": {"w2048": {"runs": {"reference": reference, "ours": ours}},
                                      "w512": {"runs": {"reference": reference, "ours": small}}}}}))

    run("2026-12-08-throughput-a.json", "2026-12-08", 0.100, 0.210, 0.204)
    run("2026-12-09-throughput-b.json", "2026-12-09", 0.110, 0.250, 0.205)
    copies = summarize.latest(tmp_path)["throughput"]["ours_copies"]
    assert list(copies) == ["w2048"] and copies["w2048"]["runs"] == 2
    assert [round(x) for x in copies["w2048"]["copy_ms"] + copies["w2048"]["alone_ms"]] == [100, 110, 6, 45]
    text = summarize.markdown(summarize.latest(tmp_path))
    assert "took 100–110 ms of the profiled step, and for 6–45 ms of them no compute ran" in text
    assert "(the run above: 45 of 110 ms)" in text
