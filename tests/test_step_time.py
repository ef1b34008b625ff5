"""The time model (nb_helpers/plan/step_time.py): its committed validation on the H200, auto-fit ranked by it, the
cards' compute figures, and where the learner sees it (plan, notebook 04)."""

import json
import sys
from pathlib import Path

import pytest

from nb_helpers.config import RunConfig
from nb_helpers.plan import step_time as st
from nb_helpers.plan.cards import CARDS, SOURCES, find_card
from nb_helpers.plan.catalog import known_shape
from nb_helpers.plan.choose import candidates
from nb_helpers.plan.planner import PlanInput

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def report():
    sys.path[:0] = [str(ROOT / "bench")]
    import step_time_report

    return step_time_report


def test_the_committed_validation_is_what_the_constants_predict_and_meets_the_target(report):
    """The committed step-time validation (bench/step_time_report.py's run file, which bench/RESULTS.md cites) came
    from the module's constants as they are, and held out of the fit, at least 12 points are predicted within 15% of
    the H200's measured step time."""
    fresh = report.validate(report.load_rows())
    latest = json.loads((ROOT / "bench" / "results" / "latest.json").read_text())
    committed = json.loads((ROOT / latest["step_time"]["run_file"]).read_text())["results"]
    assert committed["held_out"] == latest["step_time"]["held_out"]
    assert [p["predicted_step_s"] for p in fresh["points"]] == [p["predicted_step_s"] for p in committed["points"]]
    assert fresh["held_out_points"] >= 12
    assert fresh["held_out"]["step_error"]["within_15pct"] >= 12
    assert fresh["held_out"]["busy_error"]["within_15pct"] >= 12
    assert not {p["id"] for p in fresh["points"] if p["held_out"]} & report.FIT_IDS


def test_fitting_again_gives_the_module_constants(report):
    rows = [r for r in report.load_rows() if r["id"] in report.FIT_IDS]
    for unit, seconds in report.fit_gpu(rows).items():
        assert seconds == pytest.approx(st.GPU_SECONDS[unit][0], rel=1e-3), unit


def tinyllama(seq: int, capability=(9, 0), dtype="bfloat16", context=0.60) -> PlanInput:
    return PlanInput(seq=seq, batch=1, accum=8, context_gib=context, gpu_capability=capability, compute_dtype=dtype,
                     graphs=True)


@pytest.mark.parametrize("seq, batch, offload, graphs", [(512, 8, False, True), (2048, 8, True, False),
                                                         (128, 8, False, True)])
def test_on_the_h200_the_ranking_finds_todays_choices(seq, batch, offload, graphs):
    """W512, W2048 and the shipped data (rows padded to 128): what the H200's throughput runs measured as ours
    (bench/RESULTS.md)."""
    best = candidates(known_shape("tinyllama-1.1b"), tinyllama(seq), 8, 4.0, gpu=st.H200)[0]
    assert (best.batch, best.gradient_checkpointing, best.offload, best.graphs) == (batch, True, offload, graphs)


def test_on_a_gtx1650_a_setting_without_recompute_beats_a_graphed_checkpointed_one():
    card = find_card("gtx1650")
    options = candidates(known_shape("tinyllama-1.1b"), tinyllama(512, (7, 5), "float16", 0.30), 8,
                         card.budget_gib(), gpu=card.compute())
    best = options[0]
    graphed = [o for o in options if o.graphs and o.gradient_checkpointing]
    assert not best.gradient_checkpointing and graphed
    assert best.predicted_step_s < min(o.predicted_step_s for o in graphed)
    assert "s/step on the GTX 1650" in best.describe()


def test_every_card_names_where_its_compute_figures_come_from():
    for card in CARDS.values():
        assert card.compute_source in SOURCES and card.tflops16 > 0 and card.bandwidth_gbs > 0, card.key
    gtx = find_card("gtx1650")  # 896 cores x 2 FLOPs x 1.665 GHz: fp16 matmuls accumulate in fp32 at its fp32 rate
    assert gtx.tflops16 == pytest.approx(896 * 2 * 1.665e9 / 1e12, rel=0.01)
    assert find_card("6 GiB").compute_source == "gtx1650-compute"


def test_a_card_twice_as_fast_halves_the_compute_bound_time_only():
    shape, inp = known_shape("tinyllama-1.1b"), PlanInput(seq=2048, batch=4, accum=2)
    slow = st.predict_step_time(shape, inp, find_card("gtx1650").compute())
    fast = st.predict_step_time(shape, inp, {**find_card("gtx1650").compute(), "tflops16": 2 * 2.98})
    assert fast.gpu_by_kind_s["matmul"] < 0.55 * slow.gpu_by_kind_s["matmul"]
    assert fast.gpu_by_kind_s["dequantize"] == pytest.approx(slow.gpu_by_kind_s["dequantize"])
    assert slow.step_s > slow.host_s  # compute-bound on the learner's card: the GPU's time decides
    on_h200 = st.predict_step_time(shape, inp, st.H200)
    assert on_h200.step_s == pytest.approx(on_h200.host_s + st.STEP_S)  # host-bound there, eager


def test_plan_prints_the_time_and_auto_fit_its_choice_with_it(cli):
    result = cli("plan", "--model", str(ROOT / "nb_helpers" / "plan" / "shapes" / "tinyllama-1.1b.json"),
                 "--auto-fit")
    assert result.returncode == 0
    assert "time: ~" in result.stdout and "GTX 1650" in result.stdout and "not a measurement" in result.stdout
    assert "gradient checkpointing off" in result.stdout.split("auto-fit for effective batch 8:")[1]


def test_notebook_04_compares_time_only_on_the_gpu_predicted_for():
    same = st.time_note({"predicted_step_s": 0.30, "predicted_step_gpu": "NVIDIA H200", "median_step_s": 0.25,
                         "device": "NVIDIA H200", "predicted_for_this_gpu": True})
    assert "measured 0.25 s (+20.0%)" in same
    other = st.time_note({"predicted_step_s": 4.2, "predicted_step_gpu": "GTX 1650 (4 GB)", "median_step_s": 0.3,
                          "device": "NVIDIA H200"})
    assert "not a measurement" in other and "not that card" in other
    assert "No step-time prediction" in st.time_note({})


def test_no_gpu_plans_the_course_card_and_an_unknown_gpu_none(monkeypatch, no_gpu):
    import torch

    assert st.timing_gpu(RunConfig())["name"] == find_card("gtx1650").name  # this CPU: the course's card
    assert st.timing_gpu(RunConfig(card="t4"))["tflops16"] == 65.0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA GeForce RTX 4090")
    assert st.timing_gpu(RunConfig()) is None  # not modelled: auto-fit keeps its older rule
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")
    assert st.timing_gpu(RunConfig()) is st.H200


def test_the_plan_panel_of_notebooks_02_and_03_shows_the_time_for_the_card(no_gpu):  # card unset: the course card
    from nb_helpers.ui.widgets import plan_widget

    view = plan_widget(RunConfig(), known_shape("tinyllama-1.1b"))  # no GPU here: the course's GTX 1650
    assert "time: ~" in view.widget.value and "GTX 1650" in view.widget.value
    view.update(RunConfig(card="rtx3050-laptop-4gb"))
    assert "RTX 3050 laptop" in view.widget.value.split("time: ~")[1][:120]


def test_the_run_time_counts_epochs_over_the_training_rows(tmp_path):
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join('{"text": "x"}\n' for _ in range(20)) + "\n")
    assert st.optimizer_steps(RunConfig(train_file=str(rows), num_train_epochs=3)) == 3 * 3  # 20 rows / 8 per step
    assert st.optimizer_steps(RunConfig(train_file=str(rows), max_steps=5)) == 5
    assert st.optimizer_steps(RunConfig(train_file=str(tmp_path / "missing.jsonl"))) is None


def test_a_real_card_is_recognised_as_the_gpu_predicted_for(monkeypatch):
    import torch

    from nb_helpers.plan.planner import plan_for_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA GeForce GTX 1650")
    cfg = RunConfig(card="gtx1650")
    planned = plan_for_config(cfg, known_shape("tinyllama-1.1b"), context_gib=0.3, gpu_capability=(7, 5))
    assert st.predicted_time(planned, cfg, verbose=False)["predicted_for_this_gpu"]
    assert not st.predicted_time(planned, RunConfig(card="t4"), verbose=False)["predicted_for_this_gpu"]


def test_a_whole_run_reads_in_seconds_minutes_or_hours():
    assert [st.duration(x) for x in (13.3, 600, 5000, 6240)] == ["13 s", "10 min", "83 min", "1.7 h"]


def test_a_kept_absmax_takes_one_launch_per_dequantize_and_leaves_the_rest():
    """fast.fused_lora.keep_decoded_absmax: each dequantize runs the weight's kernel only, not the absmax's too."""
    shape = known_shape("tinyllama-1.1b")
    per_call = st.work_per_micro_step(shape, PlanInput(seq=512, batch=8, absmax_once=False))
    kept = st.work_per_micro_step(shape, PlanInput(seq=512, batch=8, absmax_once=True))
    assert kept["dequant_launches"] * 2 == per_call["dequant_launches"] > 0
    assert {k: v for k, v in kept.items() if k != "dequant_launches"} == \
        {k: v for k, v in per_call.items() if k != "dequant_launches"}


def test_the_kept_attention_costs_a_pair_in_flight_each_way_and_saves_the_recompute_s_attention():
    """Lever saved_attention (fast.saved_attention): offloaded eager checkpoints keep each layer's attention output
    and log-sum-exp in CPU RAM too. The card holds one more pair while they are copied out and one fetched back early;
    the recompute attends no more; the copies carry them. With graphs, checkpoints on the card, or no recompute stash,
    nothing changes."""
    from dataclasses import replace

    from nb_helpers.plan.planner import plan

    shape = known_shape("tinyllama-1.1b")
    base = PlanInput(seq=2048, batch=8, accum=1, offload=True, down_once=True, dropout_kernels=True)
    on, off = replace(base, saved_attention=True), replace(base, saved_attention=False)
    pair = 8 * 2048 * shape.heads * (shape.head_dim * 2 + 4)
    assert (plan(shape, on).peak_gib - plan(shape, off).peak_gib) * 2**30 == pytest.approx(2 * pair, rel=1e-6)
    work_on, work_off = st.work_per_micro_step(shape, on), st.work_per_micro_step(shape, off)
    passes = 1 + st.BACKWARD_OVER_FORWARD
    assert work_on["attention_flops"] / work_off["attention_flops"] == pytest.approx(passes / (passes + 1))
    assert {k: v for k, v in work_on.items() if k != "attention_flops"} == \
        {k: v for k, v in work_off.items() if k != "attention_flops"}
    assert st.offload_seconds(shape, on, st.H200, 0.0) > st.offload_seconds(shape, off, st.H200, 0.0)
    for other in (replace(on, graphs=True), replace(on, offload=False), replace(on, down_once=False)):
        plain = replace(other, saved_attention=False)
        assert plan(shape, other).peak_gib == plan(shape, plain).peak_gib
        assert st.work_per_micro_step(shape, other) == st.work_per_micro_step(shape, plain)
