"""One config carried from notebook to notebook: what you choose with the sliders in 02 and 03 is what 03 trains
and 04 compares, instead of each notebook starting again from default_config().

The choices live in one small JSON file next to the runs (`runs/course-config.json`; `runs/ci/...` in CI mode),
holding only the knobs the sliders set. The widgets write it after every valid change; `course_config()` reads it.
Delete the file to start again from the defaults. Because it holds plain RunConfig keys, it also works as an
overrides file for the command line: `NB_CONFIG=runs/course-config.json python -m nb_helpers train`.
"""

from __future__ import annotations

import json
from pathlib import Path

from nb_helpers.config import ConfigError, RunConfig, default_config, read_knobs

CARRY_FILE = "course-config.json"


def carry_path(cfg: RunConfig) -> Path:
    """Where the choices of this config's course live: beside its run folders (runs/ or runs/ci/)."""
    return cfg.resolve_path(cfg.runs_dir) / CARRY_FILE


def carried_choices(cfg: RunConfig) -> dict:
    """The knobs saved by the sliders for this course, or {} when none were moved yet."""
    path = carry_path(cfg)
    return read_knobs(path, str(path), "delete it to start again from the defaults") if path.exists() else {}


def course_config(**overrides) -> RunConfig:
    """default_config(), then the choices carried from earlier notebooks (printed, with the file they came from)."""
    cfg = default_config(**overrides)
    choices = {k: v for k, v in carried_choices(cfg).items() if k not in overrides}
    if not choices:
        return cfg
    path = carry_path(cfg)
    try:
        carried = RunConfig.from_dict({**cfg.to_dict(), **choices}).validate()
    except ConfigError as e:
        raise ConfigError(f"{path} (the sliders' saved choices): {e}\nDelete the file to start again from the "
                          "defaults.") from None
    if changed := {k: v for k, v in choices.items() if getattr(cfg, k) != v}:
        print(f"[config] carried from earlier notebooks ({path}): "
              + ", ".join(f"{k}={v}" for k, v in changed.items()) + "; delete that file to start from the defaults")
    return carried


def save_choices(cfg: RunConfig, fields) -> Path:
    """Merge the current values of `fields` into the course's file (other notebooks' choices stay)."""
    path = carry_path(cfg)
    data = carried_choices(cfg)
    data.update({name: getattr(cfg, name) for name in fields})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)  # atomic: a kernel stopped mid-write never leaves half a file
    return path
