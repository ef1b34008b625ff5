"""The model shapes that ship with the package (nb_helpers/plan/shapes/*.json: public config.json files, no weights):
the choices of a model-family widget, and the planner's prediction for one of them with a config's knobs."""

from __future__ import annotations

from pathlib import Path

from nb_helpers.plan.architecture import Shape, load_shape
from nb_helpers.plan.planner import Plan, plan_for_config


def shapes_dir() -> Path:
    return Path(__file__).resolve().parent / "shapes"


def known_shapes() -> dict[str, str]:
    """name -> one line about it, for every public model whose config.json ships in nb_helpers/plan/shapes/ (Qwen3,
    Gemma 3, Llama-3.2, Phi-4-mini, ...): the choices of a model-family widget. No download, no weights."""
    paths = sorted(shapes_dir().glob("*.json"))
    if not paths:
        raise FileNotFoundError(f"no model shapes in {shapes_dir()}: they are package data of nb_helpers.plan; "
                                "reinstall the package (pip install -e .)")
    return {path.stem: load_shape(str(path)).describe() for path in paths}


def known_shape(name: str) -> Shape:
    """One of known_shapes() by name (e.g. "qwen3-1.7b"), read from its config.json in nb_helpers/plan/shapes/."""
    path = shapes_dir() / f"{name}.json"
    if not path.exists():
        raise ValueError(f"no shape {name!r}; known: {', '.join(known_shapes())}")
    return load_shape(str(path))


def plan_for_family(cfg, name: str, context_gib: float | None = None,
                    gpu_capability: tuple[int, int] | None = None) -> Plan:
    """plan_for_config for one of known_shapes(), with the config's other knobs as they are."""
    return plan_for_config(cfg, known_shape(name), context_gib=context_gib, gpu_capability=gpu_capability)
