"""The last layers keep their activations instead of recomputing them (RunConfig.no_recompute_layers,
nb_helpers.fast.checkpoints): the same loss and gradients as checkpointing every layer, no recompute in those layers,
the planner's memory and time for it, and auto-fit's choice. On the CPU with the real fused 4-bit layers in fp32; on
the GPU (marked) eager, offloaded and as CUDA graphs."""

from dataclasses import asdict

import pytest
import torch

from fused_models import fused_model, train_step, use_checkpoints
from nb_helpers.fast import checkpoints, fused_lora, state
from nb_helpers.fast.options import FastOptions
from nb_helpers.fast.state import FastPath
from nb_helpers.fast.mask import decoder_of
from nb_helpers.plan.architecture import recomputed_layers
from nb_helpers.plan.choose import KEPT_FACTOR, OFFLOAD_FACTOR, candidates, most_layers_kept
from nb_helpers.plan.planner import PlanInput, plan
from nb_helpers.plan.step_time import H200, predict_step_time


def _dequantizes_per_layer(monkeypatch, model) -> dict:
    """Calls of fused_lora._dequantize, per decoder layer index."""
    layer_of = {}
    for index, layer in enumerate(decoder_of(model).layers):
        for module in layer.modules():
            if hasattr(getattr(module, "weight", None), "quant_state"):
                layer_of[id(module.weight)] = index
    counts: dict = {}
    real = fused_lora._dequantize

    def counting(weight, direct=False):
        counts[layer_of.get(id(weight))] = counts.get(layer_of.get(id(weight)), 0) + 1
        return real(weight, direct)

    monkeypatch.setattr(fused_lora, "_dequantize", counting)
    return counts


@pytest.mark.parametrize("targets", [None, ["all-linear"]])
def test_the_last_layer_keeps_its_activations_with_the_same_gradients(tiny_cfg, monkeypatch, targets):
    """Two layers, the last not recomputed: its weights are dequantized twice a step (forward, backward), the first
    layer's three times (forward, recompute, backward); loss and gradients those of checkpointing both."""
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(4))
    model = fused_model(tiny_cfg, targets=targets, fused_block=False)
    weights_per_layer = len({id(m.weight) for m in decoder_of(model).layers[0].modules()
                             if hasattr(getattr(m, "weight", None), "quant_state")})  # a LoRA layer and its base
    use_checkpoints(model, dead_tail=False)
    every = [train_step(model, ids) for _ in range(2)]
    use_checkpoints(model, dead_tail=False, no_recompute=1)
    counts = _dequantizes_per_layer(monkeypatch, model)
    last_kept = [train_step(model, ids) for _ in range(2)]
    assert counts == {0: 2 * 3 * weights_per_layer, 1: 2 * 2 * weights_per_layer}, counts
    layers = decoder_of(model).layers
    assert layers[1]._gradient_checkpointing_func is checkpoints.called_directly
    assert layers[0]._gradient_checkpointing_func is not checkpoints.called_directly
    for (loss_every, grads_every), (loss_kept, grads_kept) in zip(every, last_kept):
        assert torch.equal(loss_every, loss_kept)
        assert len(grads_every) == len(grads_kept) > 0
        for a, b in zip(grads_every, grads_kept):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-8)


def test_more_layers_kept_than_there_are_keeps_them_all(tiny_cfg):
    model = fused_model(tiny_cfg, fused_block=False)
    use_checkpoints(model, dead_tail=True, no_recompute=5)
    assert all(layer._gradient_checkpointing_func is checkpoints.called_directly for layer in decoder_of(model).layers)
    assert checkpoints.no_recompute_layers(model) == 5
    use_checkpoints(model, dead_tail=True, no_recompute=0)
    assert not any(layer._gradient_checkpointing_func is checkpoints.called_directly
                   for layer in decoder_of(model).layers)


def test_on_a_cpu_the_knob_says_it_does_not_apply(tiny_cfg, capsys, monkeypatch):
    from nb_helpers import frontend

    if torch.cuda.is_available():
        pytest.skip("the CPU's note")
    monkeypatch.setattr(frontend, "_SAID", set())
    model = fused_model(tiny_cfg, fused_block=False)
    state.path_of(model).no_recompute = 2
    assert checkpoints.install_offload(model, False) is False
    assert "no_recompute_layers applies on a CUDA GPU" in capsys.readouterr().out


def test_the_knob_is_checked_and_shown(tiny_cfg):
    from nb_helpers.config import ConfigError

    with pytest.raises(ConfigError, match="no_recompute_layers"):
        tiny_cfg.replace(no_recompute_layers=-1)
    line = tiny_cfg.replace(gradient_checkpointing=True, no_recompute_layers=3).summary_line()
    assert "the last 3 layers not recomputed" in line
    assert "not recomputed" not in tiny_cfg.replace(gradient_checkpointing=False, no_recompute_layers=3).summary_line()


# --- the planner --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tinyllama():
    from nb_helpers.plan.catalog import known_shape

    return known_shape("tinyllama-1.1b")


def _inp(**changes) -> PlanInput:
    base = PlanInput(seq=512, batch=8, accum=1, gpu_capability=(9, 0), context_gib=0.5, dropout_kernels=True)
    return PlanInput(**{**asdict(base), **changes})


@pytest.mark.parametrize("offload", [False, True])
def test_each_layer_kept_costs_its_activations_less_its_checkpoint(tinyllama, offload):
    from nb_helpers.plan.activations import kept_activation_bytes

    every, per_layer = kept_activation_bytes(tinyllama, _inp(offload=offload), padded=False)
    three, _ = kept_activation_bytes(tinyllama, _inp(offload=offload, no_recompute_layers=3), padded=False)
    checkpoint = 2 * tinyllama.hidden * 8 * 512  # bf16 residual stream, one layer input
    assert three - every == pytest.approx(3 * per_layer * 8 * 512 - (0 if offload else 3 * checkpoint))
    peaks = [plan(tinyllama, _inp(offload=offload, no_recompute_layers=k)).peak_gib for k in range(6)]
    assert peaks == sorted(peaks) and peaks[5] > peaks[0]
    gc_off = plan(tinyllama, _inp(gradient_checkpointing=False)).components["activations_kept"]
    all_kept = plan(tinyllama, _inp(no_recompute_layers=tinyllama.layers)).components["activations_kept"]
    assert all_kept == pytest.approx(gc_off)  # every layer kept is checkpointing off


def test_the_time_model_drops_the_recompute_of_each_layer_kept(tinyllama):
    assert recomputed_layers(tinyllama, _inp(no_recompute_layers=4)) == tinyllama.layers - 4
    assert recomputed_layers(tinyllama, _inp(gradient_checkpointing=False, no_recompute_layers=4)) == 0
    busy = [predict_step_time(tinyllama, _inp(no_recompute_layers=k), H200).gpu_busy_s for k in (0, 1, 2)]
    assert busy[0] > busy[1] > busy[2]
    assert busy[0] - busy[1] == pytest.approx(busy[1] - busy[2], rel=1e-6)  # each layer's recompute, the same
    off = predict_step_time(tinyllama, _inp(gradient_checkpointing=False), H200).gpu_busy_s
    every_kept = predict_step_time(tinyllama, _inp(no_recompute_layers=tinyllama.layers), H200).gpu_busy_s
    assert every_kept == pytest.approx(off)


def test_auto_fit_keeps_as_many_layers_as_the_budget_holds(tinyllama):
    base = _inp(graphs=True)
    limit = 3.6
    most = most_layers_kept(tinyllama, base, limit)
    assert 0 < most < tinyllama.layers - 1
    assert plan(tinyllama, _inp(graphs=True, no_recompute_layers=most)).peak_gib <= limit
    assert plan(tinyllama, _inp(graphs=True, no_recompute_layers=most + 1)).peak_gib > limit
    with_lever = candidates(tinyllama, base, 8, 4.0, gpu=H200, fewer_recomputes=True)
    without = candidates(tinyllama, base, 8, 4.0, gpu=H200)
    assert not any(c.no_recompute_layers for c in without)
    kept = [c for c in with_lever if c.no_recompute_layers]
    assert kept and all(c.gradient_checkpointing for c in kept)
    assert with_lever[0].no_recompute_layers > 0  # fewer recomputes, the fastest that fits
    assert with_lever[0].predicted_step_s < without[0].predicted_step_s
    assert all(c.predicted_gib <= 4.0 * 0.95 for c in with_lever)
    assert "layers not recomputed" in with_lever[0].describe()
    # keeping activations up to the budget's edge must buy 2% (choose.KEPT_FACTOR; the GTX 1650's case is
    # tests/test_step_time.py::test_plan_prints_the_time_and_auto_fit_its_choice_with_it)
    for c in with_lever:
        margin = (KEPT_FACTOR if c.no_recompute_layers else 1.0) * (OFFLOAD_FACTOR if c.offload else 1.0)
        assert c.relative_step_cost == pytest.approx(c.predicted_step_s * margin)



# --- on the GPU ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("graphs,offload", [(False, False), (False, True), (True, False), (True, True)])
def test_on_the_gpu_the_kept_layer_gives_the_same_steps_eager_graphed_and_offloaded(tiny_cfg, graphs, offload):
    """Three steps: as the run's first micro-batches meet them, the kept layer's graphs warm up eagerly, are captured,
    then replay; fused MLP block, liger's kernels, bf16."""
    from nb_helpers.fast import graphed_layers

    graphed_layers.reset()
    model = fused_model(tiny_cfg, dtype="bfloat16", kernels=True)
    ids = torch.randint(0, 1000, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    use_checkpoints(model, dead_tail=True, offload=offload, graphs=graphs)
    every = [train_step(model, ids, torch.bfloat16) for _ in range(3)]
    graphed_layers.reset()
    use_checkpoints(model, dead_tail=True, offload=offload, graphs=graphs, no_recompute=1)
    kept = [train_step(model, ids, torch.bfloat16) for _ in range(3)]
    last = decoder_of(model).layers[-1]
    if graphs:
        entries = list(last._nb_kept_graphs.entries.values())
        assert entries and all(e.forward is not None and e.backward is not None and not e.failed for e in entries)
    for (loss_every, grads_every), (loss_kept, grads_kept) in zip(every, kept):
        assert torch.isfinite(loss_kept) and torch.allclose(loss_every, loss_kept, rtol=1e-3), (loss_every, loss_kept)
        for a, b in zip(grads_every, grads_kept):
            assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-3 * a.abs().max().item())
    graphed_layers.reset()


def test_every_process_takes_rank_0_s_choice(monkeypatch, tiny_cfg):
    """Auto-fit runs on rank 0 alone; the others get its choice as a config and must run it: offload, graphs and the
    layers not recomputed set on their own model before the Trainer turns checkpointing on."""
    from types import SimpleNamespace

    from nb_helpers import distributed
    from nb_helpers import autofit
    from nb_helpers.plan import planner

    fitted = tiny_cfg.replace(gradient_checkpointing=True, offload_checkpoints=True, cuda_graphs=True,
                              no_recompute_layers=3, micro_batch_size=4, grad_accum=2)
    monkeypatch.setattr(distributed, "is_main", lambda: False)
    monkeypatch.setattr(distributed, "broadcast", lambda value: fitted)
    monkeypatch.setattr(autofit, "longest_row_tokens", lambda rows, tokenizer: 64)
    monkeypatch.setattr(planner, "plan_for_config", lambda *args, **kwargs: "planned")
    path = FastPath(FastOptions(), offload=False, use_graphs=False, no_recompute=0)
    model = SimpleNamespace(_nb_fast_path=path)
    run = SimpleNamespace(cfg=tiny_cfg, model=model, train_rows=[], tokenizer=None, summary={}, shape=None)
    autofit.fit_to_budget(run, verbose=False)
    assert run.cfg is fitted and run.prediction == "planned"
    assert (path.offload, path.use_graphs, path.no_recompute) == (True, True, 3)
