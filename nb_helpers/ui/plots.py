"""Plot functions take data (run name -> metrics records) and return a figure; notebooks display it."""

from __future__ import annotations

import matplotlib.pyplot as plt  # noqa: F401 - importing pyplot sets up the notebook backend that displays figures
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

PANELS = [
    ("loss", "train loss"),
    ("device_used_gib", "device memory (GiB, NVML)"),
    ("step_s", "time / step (s)"),
    ("eval_loss", "eval loss"),
]


def _series(records: list[dict], key: str):
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot_training(runs: dict[str, list[dict]], vram_limit_gib: float | None = None, figsize=(10, 6)):
    """Loss, device memory, time/step and eval loss against step, one line per run on shared axes.

    The figure is not registered with pyplot, so a notebook shows it once: as the cell's value, or through
    display(fig). (A pyplot figure is shown by the backend too, so every plot appeared twice.) A notebook shows
    it as an image with alt text that names the panels and every run in the legend (CourseFigure)."""
    fig = CourseFigure(figsize=figsize)
    axes = fig.subplots(2, 2)
    for ax, (key, title) in zip(axes.flat, PANELS):
        drawn = False
        for name, records in runs.items():
            steps, values = _series(records, key)
            if key == "device_used_gib" and not values:  # CPU runs: host memory is the honest substitute
                steps, values = _series(records, "host_rss_gib")
                title = "host RSS (GiB; no GPU)"
            if values:
                few = len(values) <= 30  # a marker per point while each step can still be told apart
                ax.plot(steps, values, marker="o" if key == "eval_loss" or few else None, markersize=3, label=name)
                drawn = True
        if key == "device_used_gib" and vram_limit_gib and drawn and title.startswith("device"):
            ax.axhline(vram_limit_gib, color="red", linestyle="--", linewidth=1, label=f"{vram_limit_gib} GiB")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step", fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        low, high = ax.get_xlim()
        if drawn and high - low < 2:  # one step drawn (a run just started, or interrupted): whole-number ticks still
            middle = round((low + high) / 2)
            ax.set_xlim(middle - 1, middle + 1)
        ax.grid(alpha=0.3)
        if not drawn:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    legend = {}  # every run that drew on any panel (a run without train-loss points still has memory or eval)
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    rows = 0
    if len(runs) > 1 and legend:  # one label a row once they are long (run names with their knobs): none cut off
        columns = 1 if max(map(len, legend)) > 40 else min(3, len(legend))
        rows = -(-len(legend) // columns)
        fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=columns, fontsize=8)
    fig.tight_layout(rect=(0, 0.035 * rows + (0.02 if rows else 0), 1, 1))
    points = {name: [r["step"] for r in records if r.get("loss") is not None] for name, records in runs.items()}
    fig.alt = ("training panels against the optimizer step (" + ", ".join(ax.get_title() for ax in axes.flat)
               + "); " + ("legend: " + ", ".join(t.get_text() for t in fig.legends[0].get_texts())
                          if fig.legends else f"run: {', '.join(runs)}")
               + "; train-loss points: " + "; ".join(f"{n}: {_steps_text(s)}" for n, s in points.items()))
    return fig


def _steps_text(steps: list[int]) -> str:
    if not steps:
        return "none"
    return f"{len(steps)} (steps {', '.join(map(str, steps))})" if len(steps) <= 40 else \
        f"{len(steps)} (steps {steps[0]}-{steps[-1]})"


class CourseFigure(Figure):
    """A matplotlib Figure that a notebook shows as an HTML image with alt text and an optional caption line
    under it (text, so it never collides with the panel titles). Exporters that skip HTML get the PNG."""

    alt: str = ""
    caption: str = ""

    def _repr_html_(self) -> str:
        import base64
        import io
        from html import escape

        buffer = io.BytesIO()
        self.savefig(buffer, format="png")
        png = base64.b64encode(buffer.getvalue()).decode("ascii")
        caption = f"<figcaption>{escape(self.caption)}</figcaption>" if self.caption else ""
        return (f"<figure class='nb-figure' style='margin:0'><img style='max-width:100%' "
                f"src='data:image/png;base64,{png}' alt='{escape(self.alt, quote=True)}'>{caption}</figure>")


class LivePlot:
    """Redraws the training panels in place every `every` steps while a notebook cell trains, with a caption line
    under the figure that gives the latest step, loss and time. Records that come before the first step (the eval
    loss measured before training) wait for it, so the figure appears in the cell that trains, not in an earlier
    one the learner has scrolled past."""

    REDRAW_S = 20.0  # a slow run redraws at least this often: an interrupt leaves the figure at most this stale

    def __init__(self, name: str = "this run", every: int = 1):
        self.name, self.every, self.records, self._handle, self._drawn_at = name, every, [], None, 0.0

    def __call__(self, record: dict) -> None:
        import time

        from IPython.display import display

        self.records.append(record)
        steps = [r for r in self.records if "loss" in r]
        due = time.monotonic() - self._drawn_at >= self.REDRAW_S
        if not steps or ("loss" in record and record["step"] % self.every and len(steps) > 1 and not due):
            return
        self._drawn_at = time.monotonic()
        fig = plot_training({self.name: self.records}, figsize=(9, 5))
        fig.caption = self.caption()
        if self._handle is None:
            self._handle = display(fig, display_id=True)
        else:
            self._handle.update(fig)

    def caption(self) -> str:
        r = [r for r in self.records if "loss" in r][-1]
        return f"{self.name}: step {r['step']}, loss {r['loss']:.3f}" + \
            (f", {r['step_s']:.2f} s/step" if r.get("step_s") is not None else "")


def plot_benchmark(bench, figsize=(9, 3.2)):
    """Tokens/s and peak device memory of the reference recipe and our path, per workload (nb_helpers.ui.benchmarks),
    with the budget as a dashed line on the memory panel."""
    fig = CourseFigure(figsize=figsize)
    speed, memory = fig.subplots(1, 2)
    workloads = list(dict.fromkeys(r.workload for r in bench.rows))
    recipes = list(dict.fromkeys(r.recipe for r in bench.rows))  # reference first, as the file lists them
    width = 0.76 / len(recipes)
    for i, recipe in enumerate(recipes):
        offset = (i - (len(recipes) - 1) / 2) * width
        rows = {r.workload: r for r in bench.rows if r.recipe == recipe}
        xs = [i + offset for i in range(len(workloads))]
        speed.bar(xs, [rows[w].tokens_per_s for w in workloads], width, label=recipe)
        memory.bar(xs, [rows[w].peak_device_gib for w in workloads], width, label=recipe)
    memory.axhline(bench.budget_gib, color="red", linestyle="--", linewidth=1, label=f"{bench.budget_gib:g} GiB")
    for ax, title in ((speed, "tokens / s"), (memory, "peak device memory (GiB)")):
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    memory.set_ylim(0, bench.budget_gib * 1.25)  # room above the budget line for the legend
    speed.legend(fontsize=8)
    memory.legend(fontsize=8, loc="upper left", ncol=3)
    fig.tight_layout()
    ratios = [f"{r.workload} {r.ratio:.1f}x" for r in bench.rows if r.recipe == recipes[-1]]
    fig.alt = (f"bars of tokens/s and peak memory, reference recipe against our path, on {bench.gpu}; our speed over "
               f"the reference: {', '.join(ratios)}")
    return fig
