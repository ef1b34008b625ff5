"""ipywidgets bound to the config object: moving a slider changes the RunConfig that training reads."""

from __future__ import annotations

from .config import ConfigError, RunConfig

# field -> (widget kind, options, description). Options are the values worth trying on a 4 GB card.
CONTROLS = {
    "lora_r": ("select", [1, 2, 4, 8, 16, 32, 64], "LoRA rank r"),
    "lora_alpha": ("select", [1, 2, 4, 8, 16, 32, 64, 128], "LoRA alpha"),
    "lora_dropout": ("float", (0.0, 0.3, 0.01), "LoRA dropout"),
    "micro_batch_size": ("select", [1, 2, 4, 8, 16], "micro-batch"),
    "grad_accum": ("select", [1, 2, 4, 8, 16, 32], "grad accum"),
    "max_length": ("select", [128, 192, 256, 512, 1024, 2048], "max length"),
    "learning_rate": ("log", (-5, -3, 0.1), "learning rate"),
    "max_steps": ("int", None, "max steps (-1=epochs)"),
    "num_train_epochs": ("floattext", None, "epochs"),
}
LORA_FIELDS = ("lora_r", "lora_alpha", "lora_dropout")
TRAIN_FIELDS = ("lora_r", "grad_accum", "micro_batch_size", "max_length", "learning_rate", "max_steps", "num_train_epochs")


def _make(kind, options, description, value):
    import ipywidgets as w

    style = {"description_width": "150px"}
    if kind == "select":
        options = sorted(set(options) | {value})
        return w.SelectionSlider(options=options, value=value, description=description, style=style)
    if kind == "float":
        lo, hi, step = options
        return w.FloatSlider(value=value, min=lo, max=hi, step=step, description=description, style=style)
    if kind == "log":
        lo, hi, step = options
        return w.FloatLogSlider(value=value, base=10, min=lo, max=hi, step=step, description=description,
                                style=style, readout_format=".1e")
    if kind == "int":
        return w.IntText(value=value, description=description, style=style)
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
