"""ipywidgets bound to the config object: moving a slider changes the RunConfig that training reads, and the
planner's predicted peak memory follows it live."""

from __future__ import annotations

import html

from .config import ConfigError, RunConfig

# field -> (widget kind, options, description). Options are the values worth trying on a 4 GB card.
CONTROLS = {
    "lora_r": ("select", [1, 2, 4, 8, 16, 32, 64], "LoRA rank r"),
    "lora_alpha": ("select", [1, 2, 4, 8, 16, 32, 64, 128], "LoRA alpha"),
    "lora_dropout": ("float", (0.0, 0.3, 0.01), "LoRA dropout"),
    "micro_batch_size": ("select", [1, 2, 4, 8, 16], "micro-batch"),
    "grad_accum": ("select", [1, 2, 4, 8, 16, 32], "grad accum"),
    "max_length": ("select", [128, 192, 256, 512, 1024, 2048], "max length"),
    # Exact values, not a log slider: a FloatLogSlider snaps 2e-4 to 10**-3.7 = 1.995e-4 as soon as it is displayed
    "learning_rate": ("select", [5e-5, 1e-4, 2e-4, 3e-4, 4e-4, 5e-4, 1e-3], "learning rate"),
    "max_steps": ("int", None, "max steps (-1=epochs)"),
    "num_train_epochs": ("floattext", None, "epochs"),
    "gradient_checkpointing": ("bool", None, "gradient checkpointing"),
}
LORA_FIELDS = ("lora_r", "lora_alpha", "lora_dropout")
TRAIN_FIELDS = ("lora_r", "grad_accum", "micro_batch_size", "max_length", "gradient_checkpointing", "learning_rate",
                "max_steps", "num_train_epochs")


def _make(kind, options, description, value):
    import ipywidgets as w

    style = {"description_width": "150px"}
    if kind == "select":
        options = [(f"{v:g}", v) for v in sorted(set(options) | {value})]  # (label, value): values stay exact
        return w.SelectionSlider(options=options, value=value, description=description, style=style)
    if kind == "float":
        lo, hi, step = options
        return w.FloatSlider(value=value, min=lo, max=hi, step=step, description=description, style=style)
    if kind == "int":
        return w.IntText(value=value, description=description, style=style)
    if kind == "bool":
        return w.Checkbox(value=bool(value), description=description, style=style)
    return w.FloatText(value=value, description=description, style=style)


def config_widgets(cfg: RunConfig, fields=TRAIN_FIELDS, on_change=None):
    """A box of controls that write straight into `cfg`; `on_change(cfg)` runs after each valid change."""
    import ipywidgets as w

    status = w.HTML()

    def refresh():
        status.value = (f"<b>effective batch</b> = {cfg.micro_batch_size} x {cfg.grad_accum} = {cfg.effective_batch} "
                        f"sequences per optimizer step &nbsp;|&nbsp; {cfg.summary_line()}")

    controls = []
    for name in fields:
        kind, options, description = CONTROLS[name]
        control = _make(kind, options, description, getattr(cfg, name))

        def changed(change, name=name):
            old = getattr(cfg, name)
            setattr(cfg, name, change["new"])
            try:
                cfg.validate()
            except ConfigError as e:
                setattr(cfg, name, old)
                status.value = f"<span style='color:#b00'>{e}</span>"
                return
            refresh()
            if on_change:
                on_change(cfg)

        control.observe(changed, names="value")
        controls.append(control)
    refresh()
    return w.VBox(controls + [status])


# --- the planner's predicted peak, live -------------------------------------------------------------------------
COURSE_CARD_GIB = 4.0  # the card this course targets (GTX 1650 / RTX 3050 class), CUDA context included
FITS_COLOR, OVER_COLOR = "#080", "#b00"


class PlanView:
    """The planner's predicted peak for `cfg` against a budget, with its breakdown, in an ipywidgets.HTML.

    `update(cfg)` recomputes it (pass it as `config_widgets(..., on_change=view.update)`); `view.plan` is the
    latest nb_helpers.planner.Plan (None when the planner could not answer). Display it with `display(view)`."""

    def __init__(self, cfg: RunConfig, shape, budget_gib: float | None = None, context_gib: float | None = None):
        import ipywidgets as w

        from .dtypes import cuda_capability
        from .planner import default_context_gib, load_shape

        # Everything that does not depend on the knobs is worked out once: config.json, the GPU, its CUDA context.
        self.shape, self.shape_error = shape, None
        if shape is not None and not hasattr(shape, "hidden"):  # a model folder or config.json: read it now, once
            try:
                self.shape = load_shape(str(shape))
            except Exception as e:  # noqa: BLE001 - a model the planner cannot read still trains; say so
                self.shape, self.shape_error = None, f"cannot read {shape}'s config.json ({e})"
        self.budget_gib = budget_gib
        self.capability = cuda_capability()
        self.context_gib = default_context_gib() if context_gib is None else context_gib
        if self.capability is None:
            self.device_note = (f"predicted for a GTX 1650-class card (compute capability 7.5, CUDA context "
                                f"{self.context_gib:.2f} GiB), since there is no CUDA GPU here")
        else:
            import torch

            self.device_note = (f"predicted for this GPU ({torch.cuda.get_device_name(0)}, compute capability "
                                f"{self.capability[0]}.{self.capability[1]}, CUDA context {self.context_gib:.2f} GiB)")
        self.plan = None
        self.widget = w.HTML()
        self.update(cfg)

    def budget_for(self, cfg: RunConfig) -> tuple[float, str]:
        """The budget and where it comes from: the argument, else cfg.budget_gib, else the course's 4 GB card."""
        if self.budget_gib is not None:
            return self.budget_gib, "given to plan_widget"
        if cfg.budget_gib is not None:
            return cfg.budget_gib, "cfg.budget_gib"
        return COURSE_CARD_GIB, "the 4 GB card this course targets (set cfg.budget_gib for another card)"

    def update(self, cfg: RunConfig) -> None:
        from .planner import plan_for_config

        budget, source = self.budget_for(cfg)
        try:
            if self.shape is None:
                raise ValueError(self.shape_error or "no model shape: pass load_shape(model path)")
            result = plan_for_config(cfg, self.shape, context_gib=self.context_gib,
                                     gpu_capability=self.capability or (7, 5))
        except Exception as e:  # noqa: BLE001 - a widget callback must not raise; say why instead
            self.plan = None
            self.widget.value = (f"<div style='color:{OVER_COLOR}'><b>no prediction</b> for these settings: "
                                 f"{html.escape(str(e))}</div>")
            return
        result.budget_gib = budget
        self.plan = result
        self.widget.value = plan_html(result, source, self.device_note)

    def _repr_mimebundle_(self, **kwargs):
        # The live widget where a widget frontend runs; a static copy of the HTML elsewhere (nbconvert, GitHub).
        return {**self.widget._repr_mimebundle_(**kwargs), "text/html": self.widget.value}


def plan_html(result, budget_source: str, device_note: str) -> str:
    """The verdict line (green fits, red does not fit), then a compact table of the non-zero components in GiB."""
    from .planner import COMPONENT_LABELS, GIB

    peak, budget = result.peak_gib, result.budget_gib
    if result.fits:
        line = (f"<span style='color:{FITS_COLOR}'><b>&#10004; fits</b>: predicted peak <b>{peak:.2f} GiB</b> of "
                f"{budget:.2f} GiB ({budget - peak:.2f} GiB to spare)</span>")
    else:
        if result.peak_phase.startswith("loading"):
            advice = "The peak is the fp32 upcast while loading, which no training knob changes: pick a smaller model"
        else:
            advice = ("Lower max length or micro-batch (raise accumulation to keep the effective batch)"
                      + ("" if result.inputs.gradient_checkpointing else ", or turn gradient checkpointing on"))
        line = (f"<span style='color:{OVER_COLOR}'><b>&#10008; does not fit</b>: predicted peak <b>{peak:.2f} GiB</b> "
                f"of {budget:.2f} GiB ({peak - budget:.2f} GiB over). {advice}.</span>")
    cell = "style='padding:0 10px 0 0;text-align:{}'"
    rows = []
    for key, value in result.components.items():
        if value <= 0:
            continue
        gib = value / GIB
        shown = "&lt;0.001" if gib < 0.0005 else f"{gib:.3f}"
        rows.append(f"<tr><td {cell.format('left')}>{html.escape(COMPONENT_LABELS.get(key, key))}</td>"
                    f"<td {cell.format('right')}>{shown}</td>"
                    f"<td {cell.format('right')}>{100 * value / result.peak_bytes:.0f}%</td></tr>")
    rows.append(f"<tr style='border-top:1px solid #999'><td {cell.format('left')}><b>total</b> (peak in "
                f"{html.escape(result.peak_phase)})</td><td {cell.format('right')}><b>{peak:.3f}</b></td><td></td></tr>")
    notes = "".join(f"<div style='color:{OVER_COLOR}'>note: {html.escape(n)}</div>" for n in result.notes)
    name = f" of {html.escape(result.shape.name)}" if result.shape.name else ""
    grey = "<div style='color:#555'>"
    return (f"<div style='font-size:0.95em'><div>{line}</div>"
            f"{grey}{html.escape(device_note)}, from the config.json{name} alone "
            "(<code>python -m nb_helpers plan</code> prints the same).</div>"
            f"{grey}budget {budget:.2f} GiB: {html.escape(budget_source)}.</div>{notes}"
            "<details open><summary>where the memory goes (GiB)</summary>"
            f"<table style='font-family:monospace;border-collapse:collapse'>"
            f"<tr><th {cell.format('left')}>component</th><th {cell.format('right')}>GiB</th>"
            f"<th {cell.format('right')}>share</th></tr>{''.join(rows)}</table></details></div>")


def plan_widget(cfg: RunConfig, shape, budget_gib: float | None = None, context_gib: float | None = None) -> PlanView:
    """Live "will it fit?": the predicted peak of `cfg` against the budget (budget_gib, else cfg.budget_gib, else
    4.0 GiB, the card this course targets), with its breakdown. `shape` is nb_helpers.planner.load_shape(model
    path), read once (a path is read here). Without a CUDA GPU the prediction is for a GTX 1650-class card
    (compute capability 7.5, CUDA context 0.30 GiB). Wire it to the sliders:

        view = plan_widget(cfg, shape)
        display(config_widgets(cfg, fields=TRAIN_FIELDS, on_change=view.update), view)
    """
    return PlanView(cfg, shape, budget_gib=budget_gib, context_gib=context_gib)
