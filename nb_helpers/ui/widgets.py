"""ipywidgets bound to the config object: moving a slider changes the RunConfig that training reads, and the
planner's predicted peak memory follows it live."""

from __future__ import annotations

import functools
import html

from nb_helpers.config import ConfigError, RunConfig
from nb_helpers.plan.planner import plan_for_config
from nb_helpers.plan.step_time import time_line
from nb_helpers.plan.cards import (CARDS, COURSE_CARD, budget_of, find_card, machine_budget_gib,
                                   planning_context_gib, run_card)

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
    # plans (and on a bigger GPU, the budget) follow it; unset = the course's GTX 1650 in plans, no cap in training
    "card": ("dropdown", [None, *CARDS], "your card"),
    # notebook 07 (DPO): how far it may move from the SFT model, and its own learning rate and steps
    "dpo_beta": ("select", [0.01, 0.05, 0.1, 0.2, 0.5, 1.0], "DPO beta"),
    "dpo_learning_rate": ("select", [1e-5, 2e-5, 5e-5, 1e-4, 2e-4], "DPO learning rate"),
    "dpo_max_steps": ("int", None, "DPO steps"),
}
LORA_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "card")
TRAIN_FIELDS = ("lora_r", "lora_alpha", "grad_accum", "micro_batch_size", "max_length", "gradient_checkpointing",
                "learning_rate", "max_steps", "num_train_epochs", "card")
PREFERENCE_FIELDS = ("dpo_beta", "lora_r", "dpo_learning_rate", "dpo_max_steps", "micro_batch_size", "grad_accum",
                     "max_length", "gradient_checkpointing", "card")
RECIPE_ALPHA_PER_RANK = 2  # the reference recipe's alpha = 2r: the update's scale alpha/r stays 2 whatever r is
# Wide enough for the longest label and a slider track a mouse can aim at (the defaults cut labels, ~54 px tracks)
LABEL_WIDTH, CONTROL_WIDTH = "190px", "560px"
FIT_WIDTH = "calc(100% - 8px)"  # a narrower window (the file browser open) shrinks a control; 8 px: its margins
# ipywidgets 8 makes a SelectionSlider's readout editable but never reads what is typed there: typing a rank left
# the readout blank while r stayed where it was. The readout only shows the choice; the handle and arrow keys move it.
CHOICE_CLASS = "nb-choice"
CHOICE_STYLE = (f"<style>.{CHOICE_CLASS} .widget-readout {{pointer-events: none; user-select: none; "
                "-webkit-user-modify: read-only}}</style>")


def _make(kind, options, description, value):
    import ipywidgets as w

    style = {"description_width": LABEL_WIDTH}
    layout = w.Layout(width=FIT_WIDTH, max_width=CONTROL_WIDTH)  # narrower windows: shrink, never clip
    common = dict(description=description, style=style, layout=layout)
    if kind == "select":
        options = [(f"{v:g}", v) for v in sorted(set(options) | {value})]  # (label, value): values stay exact
        return w.SelectionSlider(options=options, value=value, **common).add_class(CHOICE_CLASS)
    if kind == "float":
        lo, hi, step = options
        return w.FloatSlider(value=value, min=lo, max=hi, step=step, **common)
    if kind == "int":
        return w.IntText(value=value, **common)
    if kind == "bool":
        return w.Checkbox(value=bool(value), **common)
    if kind == "dropdown":  # a card's name shown, its key kept; "" stands for None (a Dropdown's None is no choice)
        labels = [("not set (plans: the course's GTX 1650)", "")] + [(CARDS[v].name, v) for v in options if v]
        extra = [] if value in options else [(str(value), value)]
        return w.Dropdown(options=labels + extra, value=value or "", **common)
    return w.FloatText(value=value, **common)


def _error_html(message: str) -> str:
    return f"<div style='color:{OVER_COLOR};white-space:pre-wrap'><b>&#10008;</b> {html.escape(message)}</div>"


class _Binding:
    """The state behind config_widgets' controls: every change goes through apply(), which validates it first."""

    def __init__(self, cfg: RunConfig, status, saved_fields: list[str], on_change, on_error, carry: bool):
        self.cfg, self.status, self.saved_fields = cfg, status, saved_fields
        self.on_change, self.on_error, self.carry = on_change, on_error, carry
        self.alpha_follows = cfg.lora_alpha == RECIPE_ALPHA_PER_RANK * cfg.lora_r
        self.syncing = False
        self.controls: dict[str, object] = {}
        self.loaded: dict | None = None  # the choices when a run was loaded from them, and what that run trains
        self.trains, self.reload_where = None, ""

    def refresh(self) -> None:
        cfg = self.cfg
        follows = " (follows r: the recipe's alpha = 2r)" if self.alpha_follows else ""
        self.status.value = CHOICE_STYLE + (f"<b>effective batch</b> = {cfg.micro_batch_size} x {cfg.grad_accum} = "
                             f"{cfg.effective_batch} sequences per optimizer step &nbsp;|&nbsp; <b>alpha/r</b> = "
                             f"{cfg.lora_alpha}/{cfg.lora_r} = {cfg.lora_alpha / cfg.lora_r:g}{follows}<br>"
                             f"{html.escape(cfg.summary_line())}" + self.after_loading())

    def after_loading(self) -> str:
        """Once a run is loaded: what it trains, and which moves since then it does not train (a note, in orange)."""
        if self.loaded is None:
            return ""
        text = f"<br><b>the loaded run trains</b>: {html.escape(self.trains.summary_line())}"
        moved = {k: (v, getattr(self.cfg, k)) for k, v in self.loaded.items() if getattr(self.cfg, k) != v}
        if moved:
            change = ", ".join(f"{k} {old} &rarr; {new}" for k, (old, new) in moved.items())
            text += (f"<div style='color:{MOVED_COLOR}'><b>&#9888; moved after loading</b> ({change}): the loaded run "
                     f"does not train this. Re-run {html.escape(self.reload_where)} to start a new run with it.</div>")
        return text

    def apply(self, changes: dict) -> None:
        cfg = self.cfg
        old = {name: getattr(cfg, name) for name in changes}
        for name, value in changes.items():
            setattr(cfg, name, value)
        try:
            cfg.validate()
        except ConfigError as e:
            for name, value in old.items():
                setattr(cfg, name, value)
            kept = ", ".join(f"{k}={v}" for k, v in old.items())
            message = f"{e}\n(the config keeps {kept} until the choice is valid)"
            self.status.value = CHOICE_STYLE + _error_html(message)
            if self.on_error:
                self.on_error(message)
            return
        self.refresh()
        if self.carry:
            from nb_helpers.course import save_choices

            save_choices(cfg, self.saved_fields)
        if self.on_change:
            self.on_change(cfg)
            self.show_config()  # on_change may set knobs itself: auto-fit's choice in the panel

    def show_config(self) -> None:
        """Each control shows cfg's value again, without counting as a move (after auto-fit wrote its choice)."""
        self.syncing = True
        try:
            for name, control in self.controls.items():
                value = getattr(self.cfg, name)
                if name != "target_modules" and control.value != value and not (name == "card" and not value):
                    control.value = value
        finally:
            self.syncing = False
        self.refresh()

    def changed(self, change, name: str) -> None:
        if self.syncing:
            return
        cfg, value = self.cfg, change["new"]
        if name == "card":
            value = value or None
        if name == "target_modules":  # the config's order for the layers it keeps: a reselection changes nothing
            value = [t for t in cfg.target_modules if t in value] + [t for t in value if t not in cfg.target_modules]
        changes = {name: value}
        if name == "lora_alpha":
            self.alpha_follows = value == RECIPE_ALPHA_PER_RANK * cfg.lora_r
        if name == "lora_r" and self.alpha_follows:
            changes["lora_alpha"] = RECIPE_ALPHA_PER_RANK * value
            if "lora_alpha" in self.controls:
                self.syncing = True  # the alpha control shows the new value without counting as a user move
                try:
                    self.controls["lora_alpha"].value = changes["lora_alpha"]
                finally:
                    self.syncing = False
        self.apply(changes)


def _controls(cfg: RunConfig, fields, targets) -> dict[str, object]:
    """One control per field (and the target selector when `targets` is given), each showing cfg's value."""
    import ipywidgets as w

    controls: dict[str, object] = {}
    for name in fields:
        kind, options, description = CONTROLS[name]
        if name == "lora_alpha":  # every alpha that following r can reach is on the slider
            ranks = set(CONTROLS["lora_r"][1]) | {cfg.lora_r}
            options = sorted(set(options) | {RECIPE_ALPHA_PER_RANK * r for r in ranks})
        controls[name] = _make(kind, options, description, getattr(cfg, name))
    if targets is not None:
        options = list(targets) + [t for t in cfg.target_modules if t not in targets]
        controls["target_modules"] = w.SelectMultiple(
            options=options, value=tuple(cfg.target_modules), rows=min(len(options), 8), description="targets",
            style={"description_width": LABEL_WIDTH}, layout=w.Layout(width=FIT_WIDTH, max_width=CONTROL_WIDTH))
    return controls


def config_widgets(cfg: RunConfig, fields=TRAIN_FIELDS, on_change=None, on_error=None, targets=None,
                   carry: bool = False, auto_fit=None):
    """A box of controls that write straight into `cfg`, with a status line under them.

    Every change is validated: a valid one updates `cfg`, the status line and `on_change(cfg)`; an invalid one
    leaves `cfg` as it was and shows the reason in red (and passes it to `on_error(message)`). `targets` (the
    model's linear layer names) adds a selector for `cfg.target_modules`. While alpha = 2r (the recipe), moving r
    moves alpha with it; once you move alpha yourself, it stays where you put it. `carry=True` saves every valid
    change for the next notebook (nb_helpers.course). `auto_fit`: the plan_widget that, where auto-fit decides, sets
    the micro-batch, accumulation and checkpointing: those controls are then marked (auto-fit) and locked."""
    import ipywidgets as w

    from nb_helpers.autofit import SLIDER_SETTINGS

    saved_fields = [*fields, *(["target_modules"] if targets is not None else [])]
    if "lora_r" in fields and "lora_alpha" not in saved_fields:
        saved_fields.append("lora_alpha")  # it follows r, so it is a choice too
    decided = auto_fit is not None and auto_fit.auto_fit_decides(cfg)
    if decided:  # auto-fit's choice is not the learner's: it is not carried to the next notebook as one
        saved_fields = [name for name in saved_fields if name not in SLIDER_SETTINGS]
    binding = _Binding(cfg, w.HTML(), saved_fields, on_change, on_error, carry)
    binding.controls = _controls(cfg, fields, targets)
    if decided:
        for name in SLIDER_SETTINGS:
            if name in binding.controls:
                control = binding.controls[name]
                control.description, control.disabled = f"{control.description} (auto-fit)", True
                control.tooltip = "auto-fit chooses this for your effective batch; AUTO_FIT = False to set it"
    for name, control in binding.controls.items():
        control.observe(lambda change, name=name: binding.changed(change, name), names="value")
    binding.refresh()
    panel = _panel_class()(list(binding.controls.values()) + [binding.status])
    panel.binding = binding
    return panel


@functools.cache
def _panel_class():
    import ipywidgets as w

    class ConfigPanel(w.VBox):
        """The controls and their status line; a static copy of both wherever no widget frontend runs."""

        binding = None

        def mark_loaded(self, trains: RunConfig, where: str) -> None:
            """A run was just loaded from the current choices: say what it trains, and from now on flag any move
            it will not train, naming the cell (`where`) that starts a new run with it."""
            b = self.binding
            b.loaded = {name: getattr(b.cfg, name) for name in b.controls}
            b.trains, b.reload_where = trains, where
            b.refresh()

        def _repr_mimebundle_(self, **kwargs):
            *controls, status = self.children
            rows = "".join(f"<tr><td style='padding-right:12px'>{html.escape(c.description)}</td>"
                           f"<td>{html.escape(_shown(c))}</td></tr>" for c in controls)
            text = "\n".join(f"{c.description}: {_shown(c)}" for c in controls)
            return {**super()._repr_mimebundle_(**kwargs), "text/plain": text,
                    "text/html": f"<table>{rows}</table><div>{status.value}</div>"}

    return ConfigPanel


def _shown(control) -> str:
    value = control.value
    if isinstance(control.value, str) and hasattr(control, "label"):  # a dropdown shows its label
        return control.label
    return ", ".join(value) if isinstance(value, tuple) else f"{value:g}" if isinstance(value, float) else str(value)


# --- the planner's predicted peak, live -------------------------------------------------------------------------
FITS_COLOR, OVER_COLOR, MOVED_COLOR = "#080", "#b00", "#b60"


class PlanView:
    """The planner's predicted peak for `cfg` against a budget, with its breakdown, in an ipywidgets.HTML.

    `update(cfg)` recomputes it (pass it as `config_widgets(..., on_change=view.update)`); `view.plan` is the
    latest nb_helpers.plan.planner.Plan (None when the planner could not answer). Display it with `display(view)`."""

    def __init__(self, cfg: RunConfig, shape, budget_gib: float | None = None, context_gib: float | None = None,
                 longest_row: int | None = None, gpu_total_gib: float | None = None):
        import ipywidgets as w

        from nb_helpers.autofit import gpu_total_gib as this_gpu_total_gib

        from nb_helpers.plan.dtypes import cuda_capability
        from nb_helpers.plan.planner import default_context_gib, load_shape

        # Everything that does not depend on the knobs is worked out once: config.json, the GPU, its CUDA context.
        self.shape, self.shape_error = shape, None
        if shape is not None and not hasattr(shape, "hidden"):  # a model folder or config.json: read it now, once
            try:
                self.shape = load_shape(str(shape))
            except Exception as e:  # noqa: BLE001 - a model the planner cannot read still trains; say so
                self.shape, self.shape_error = None, f"cannot read {shape}'s config.json ({e})"
        self.budget_gib = budget_gib
        # auto-fit's inputs: the longest training row (tokens), and the GPU it will run on (None: no CUDA GPU here)
        self.longest_row = longest_row
        self.gpu_total_gib = this_gpu_total_gib() if gpu_total_gib is None else gpu_total_gib
        self.choice = None  # auto-fit's choice at the last update, where it decides the batch
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
        """The budget and where it comes from: the argument, else cfg.budget_gib, else cfg.card's, else this GPU's
        own (its total less the desktop reserve: auto-fit's budget too), else the course's GTX 1650 (plan/cards.py)."""
        if self.budget_gib is not None:
            return self.budget_gib, "given to plan_widget"
        card = run_card(cfg)
        if card is None and cfg.budget_gib is None and self.gpu_total_gib is not None:
            reserve = " less the desktop reserve (cfg.desktop_on_card)" if cfg.desktop_on_card else ""
            return machine_budget_gib(cfg, self.gpu_total_gib), (
                f"this GPU's {self.gpu_total_gib:.2f} GiB{reserve}; auto-fit judges against the same")
        card = card or (None if cfg.budget_gib is not None else find_card(COURSE_CARD))
        source = "cfg.budget_gib" if card is None else card.describe(cfg.desktop_on_card) + (
            "" if cfg.card else "; the course's card: set cfg.card for yours")
        return budget_of(cfg, course_card=True), source

    def auto_fit_decides(self, cfg: RunConfig) -> bool:
        """Whether auto-fit will choose this run's micro-batch, accumulation and checkpointing: it is on, and the run
        has a CUDA GPU (auto-fit's trial step needs one) and its longest training row is known here."""
        return bool(cfg.auto_fit and self.gpu_total_gib is not None and self.longest_row and self.shape is not None)

    def auto_fit_unseen(self, cfg: RunConfig) -> bool:
        """Auto-fit will decide at loading, but this panel was not given the longest row to make its choice here."""
        return bool(cfg.auto_fit and self.gpu_total_gib is not None and not self.longest_row)

    def fit_sliders(self, cfg: RunConfig):
        """Where auto-fit decides: its choice before loading, written into cfg's micro-batch, accumulation and
        checkpointing (the sliders then show it), planned at the length it fits for. Returns (choice, length)."""
        from nb_helpers.autofit import SLIDER_SETTINGS, chosen_settings, planned_fit, training_length
        from nb_helpers.plan.engine import engine_view

        seq = training_length(cfg, self.longest_row)
        budget = machine_budget_gib(cfg, self.gpu_total_gib)
        offload = engine_view(cfg, self.shape, budget, None, None).can_offload
        choice = planned_fit(cfg, self.shape, seq, planning_context_gib(cfg, self.context_gib), self.gpu_total_gib,
                             offload)
        settings = chosen_settings(choice)
        for name in SLIDER_SETTINGS:
            setattr(cfg, name, settings[name])
        return choice, seq

    def update(self, cfg: RunConfig) -> None:
        from nb_helpers.plan.choose import graphs_dropped_unless_they_fit

        budget, source = self.budget_for(cfg)
        self.choice, length = None, cfg.max_length
        try:
            if self.shape is None:
                raise ValueError(self.shape_error or "no model shape: pass load_shape(model path)")
            if self.auto_fit_decides(cfg):
                self.choice, length = self.fit_sliders(cfg)
            card = run_card(cfg)  # a named card brings its own capability and context
            planned = plan_for_config(cfg.replace(budget_gib=budget, max_length=length), self.shape,
                                      context_gib=None if card else self.context_gib,  # levers hang on the budget
                                      gpu_capability=None if card else self.capability or (7, 5))
            result = graphs_dropped_unless_they_fit(planned, budget)  # what a run on that card would use
        except MemoryError as e:
            self.plan = None
            self.widget.value = (f"<div style='color:{OVER_COLOR}'><b>auto-fit finds nothing that fits</b>: "
                                 f"{html.escape(str(e))}</div>")
            return
        except Exception as e:  # noqa: BLE001 - a widget callback must not raise; say why instead
            self.plan = None
            self.widget.value = (f"<div style='color:{OVER_COLOR}'><b>no prediction</b> for these settings: "
                                 f"{html.escape(str(e))}</div>")
            return
        result.budget_gib = budget
        self.plan = result
        self.widget.value = self.what_trains(cfg, length) + time_html(result, cfg) + \
            plan_html(result, source, self.device_note)

    def what_trains(self, cfg: RunConfig, length: int) -> str:
        """One line over the prediction: these settings train as set, or auto-fit's choice (already in the sliders)."""
        if self.choice is not None:
            rows = (f"{length} tokens, the longest training row" if length < cfg.max_length else
                    f"max_length {cfg.max_length}")
            return (f"<div><b>auto-fit will train</b> {html.escape(self.choice.describe())}, at {rows}: the sliders "
                    f"marked (auto-fit) show it. Its trial step on the GPU confirms it and steps down if it runs "
                    f"out of memory. Set AUTO_FIT = False to choose them yourself</div>")
        if self.auto_fit_unseen(cfg):
            return ("<div><b>auto-fit will choose</b> the micro-batch, accumulation and checkpointing at loading, for "
                    "the longest training row: give plan_widget longest_row= (nb_helpers.autofit.longest_training_row) "
                    "to see its choice here. The prediction below is for your settings as set</div>")
        if cfg.auto_fit and self.gpu_total_gib is None:
            return "<div><b>these settings train as set</b> (auto-fit needs a CUDA GPU); the prediction is theirs</div>"
        return "<div><b>these settings train as set</b>; the prediction below is theirs</div>"

    def set_shape(self, shape, cfg: RunConfig) -> None:
        """Plan another model (a Shape from load_shape) with the same knobs."""
        self.shape, self.shape_error = shape, None
        self.update(cfg)

    def show_error(self, message: str) -> None:
        """Settings that cannot run (an empty target list, say): the reason instead of a prediction."""
        self.plan = None
        self.widget.value = (f"<div style='color:{OVER_COLOR};white-space:pre-wrap'><b>no prediction</b>: "
                             f"{html.escape(message)}</div>")

    def _repr_mimebundle_(self, **kwargs):
        # The live widget where a widget frontend runs; a static copy of the HTML elsewhere (nbconvert, GitHub).
        return {**self.widget._repr_mimebundle_(**kwargs), "text/html": self.widget.value}


def time_html(result, cfg: RunConfig) -> str:
    """The time model's line for these settings (nb_helpers.plan.step_time), or nothing for a GPU it does not know."""
    line = time_line(result, cfg)
    return f"<div style='color:#555'>{html.escape(line)}</div>" if line else ""


def plan_html(result, budget_source: str, device_note: str) -> str:
    """The verdict line (green fits, red does not fit), then a compact table of the non-zero components in GiB."""
    from nb_helpers.plan.planner import COMPONENT_LABELS, GIB

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
    return (f"<div style='font-size:0.95em;line-height:1.4'><div>{line}</div>"
            f"{grey}{html.escape(device_note)}, from the config.json{name} alone "
            "(<code>python -m nb_helpers plan</code> prints the same).</div>"
            f"{grey}budget {budget:.2f} GiB: {html.escape(budget_source)}.</div>{notes}"
            "<details open><summary>where the memory goes (GiB)</summary>"
            f"<table style='font-family:monospace;border-collapse:collapse'>"
            f"<tr><th {cell.format('left')}>component</th><th {cell.format('right')}>GiB</th>"
            f"<th {cell.format('right')}>share</th></tr>{''.join(rows)}</table></details></div>")


def plan_widget(cfg: RunConfig, shape, budget_gib: float | None = None, context_gib: float | None = None,
                longest_row: int | None = None, gpu_total_gib: float | None = None) -> PlanView:
    """Live "will it fit?": the predicted peak of `cfg` against the budget (budget_gib, else cfg.budget_gib, else
    4.0 GiB, the card this course targets), with its breakdown. `shape` is nb_helpers.plan.planner.load_shape(model
    path), read once (a path is read here). Without a CUDA GPU the prediction is for a GTX 1650-class card
    (compute capability 7.5, CUDA context 0.30 GiB). Wire it to the sliders:

        view = plan_widget(cfg, shape)
        display(config_widgets(cfg, fields=TRAIN_FIELDS, on_change=view.update, auto_fit=view), view)

    With cfg.auto_fit on a CUDA GPU and `longest_row` (nb_helpers.autofit.longest_training_row(cfg)), the panel
    makes auto-fit's choice before loading and writes it into cfg, against the budget the run uses; the sliders
    auto-fit decides say so. `gpu_total_gib` plans for another GPU's size than this machine's (tests)."""
    return PlanView(cfg, shape, budget_gib=budget_gib, context_gib=context_gib, longest_row=longest_row,
                    gpu_total_gib=gpu_total_gib)


def family_plan_widget(cfg: RunConfig, start: str | None = None, budget_gib: float | None = None):
    """A model choice over every shape in nb_helpers/plan/shapes/ (no download) and the planner's panel for the chosen one,
    with cfg's knobs; LoRA targets are translated to each family's layer names (Phi's qkv_proj, say)."""
    import ipywidgets as w

    from nb_helpers.plan.catalog import known_shape, known_shapes

    names = known_shapes()
    choice = w.Dropdown(options=[(f"{name}: {about}", name) for name, about in names.items()],
                        value=start if start in names else next(iter(names)), description="model",
                        layout=w.Layout(width="100%"), style={"description_width": "60px"})
    view = PlanView(cfg, known_shape(choice.value), budget_gib=budget_gib)
    choice.observe(lambda change: view.set_shape(known_shape(change["new"]), cfg), names="value")
    return w.VBox([choice, view.widget]), choice, view
