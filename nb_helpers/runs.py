"""Run folders: runs/<name>/ holds config.json, metrics.jsonl, adapter/, plots, predictions and summary.json.

run_name names a folder under runs_dir, nothing else. A name such as "../x" or "/tmp/x" wrote the run anywhere,
and "latest" is the link to the newest run. runs/latest itself is replaced only when it is what the course made: a
symlink, or the one-line text file naming a run that stands in for one where symlinks are not allowed (Windows)."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from nb_helpers.config import ConfigError, RunConfig
from nb_helpers.metrics import read_metrics

PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")  # not "-rf" (read as an option) nor ".hidden" (hidden)
RESERVED = {".", "..", "latest"}
# Windows' device names: a folder named CON (or con.txt) cannot be made or opened there
WINDOWS_DEVICE = re.compile(r"(CON|PRN|AUX|NUL|COM[0-9]|LPT[0-9])(\..*)?", re.I)
MAX_LEN = 100


def runs_root(cfg: RunConfig) -> Path:
    return cfg.resolve_path(cfg.runs_dir)


def check_run_name(name: str | None) -> None:
    """Refuse a run_name that is not a plain folder name, with the fix, before anything loads."""
    if name is None:
        return
    if (not isinstance(name, str) or not PLAIN_NAME.fullmatch(name) or name in RESERVED or len(name) > MAX_LEN
            or WINDOWS_DEVICE.fullmatch(name)):
        raise ConfigError(f"run_name={name!r}: use a plain folder name of letters, digits, '.', '_' and '-' (up to "
                          f"{MAX_LEN} characters, not starting with '-' or '.', not 'latest' nor a Windows device "
                          "name such as CON or NUL), e.g. run_name='r16-lr1e-4'. The run goes under runs_dir; to "
                          "write runs elsewhere, set runs_dir")


def new_run_dir(cfg: RunConfig, model_name: str) -> Path:
    """A fresh folder per run; an existing name is never reused, so no run overwrites another."""
    root = runs_root(cfg)
    root.mkdir(parents=True, exist_ok=True)
    base = cfg.run_name or f"{time.strftime('%Y%m%d-%H%M%S')}_{re.sub(r'[^A-Za-z0-9.-]+', '-', model_name)}_r{cfg.lora_r}"
    run_dir, n = root / base, 1
    while run_dir.exists() or run_dir.is_symlink():  # a dangling link too: mkdir cannot make a folder there
        n += 1
        run_dir = root / f"{base}-{n}"
    run_dir.mkdir()
    if cfg.run_name and run_dir.name != cfg.run_name:
        print(f"[run] {root / cfg.run_name} exists; writing to {run_dir} instead (nothing is overwritten)")
    return run_dir


def mark_latest(run_dir: Path) -> None:
    """runs/latest -> newest run. A symlink where the OS allows it, else a text file holding the name."""
    link = run_dir.parent / "latest"
    if not is_ours(link):
        print(f"[run] {link} is a folder or file the course did not write: left alone, so it does not point at "
              f"{run_dir.name} (rename it to let runs/latest follow the newest run)")
        return
    link.unlink(missing_ok=True)
    try:
        link.symlink_to(run_dir.name, target_is_directory=True)
    except OSError:  # Windows without developer mode
        link.write_text(run_dir.name, encoding="utf-8")


def latest_target(root: Path) -> Path | None:
    """The run folder runs/latest names now (None: there is none, or it is not the course's)."""
    link = Path(root) / "latest"
    if not (link.is_symlink() or link.is_file()) or not is_ours(link):
        return None
    target = resolve_run(link)
    return target if target.is_dir() else None


def point_latest_back(run_dir: Path, previous: Path | None) -> None:
    """runs/latest names `previous` again (or nothing) where it names `run_dir`: after a run folder is removed."""
    link = Path(run_dir).parent / "latest"
    if not (link.is_symlink() or link.is_file()) or not is_ours(link):
        return
    if resolve_run(link) != Path(run_dir).resolve():
        return  # another run took it meanwhile
    if previous is not None and previous.is_dir():
        mark_latest(previous)
    else:
        link.unlink(missing_ok=True)


def is_ours(latest: Path) -> bool:
    """runs/latest may be replaced: absent, a symlink, or a small text file holding just a run's name."""
    if latest.is_symlink() or not latest.exists():
        return True
    if not latest.is_file() or latest.stat().st_size > MAX_LEN + 2:
        return False
    try:
        name = latest.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return False
    return bool(PLAIN_NAME.fullmatch(name)) and name not in RESERVED


def resolve_run(path: str | Path) -> Path:
    if not isinstance(path, (str, Path)):
        raise ConfigError(f"{path!r} ({type(path).__name__}) is not a run folder: give its path as a str or "
                          "pathlib.Path, e.g. 'runs/latest'")
    path = Path(path)
    if path.is_file() and path.name == "latest":
        return (path.parent / path.read_text(encoding="utf-8").strip()).resolve()
    return path.resolve()


def write_json(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half file beside the old one
        raise
    tmp.replace(path)  # atomic: a crash mid-write leaves the old file, never half a file


@dataclass
class Run:
    path: Path
    config: dict
    metrics: list[dict]
    summary: dict

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def label(self) -> str:
        c = self.config
        return (f"{self.name} (r={c.get('lora_r')}, alpha={c.get('lora_alpha')}, "
                f"{c.get('micro_batch_size')}x{c.get('grad_accum')})")


def load_run(path: str | Path) -> Run:
    path = resolve_run(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such run folder — train first (notebook 03) or pick one from list_runs()")
    return Run(path, read_json(path / "config.json"), read_metrics(path / "metrics.jsonl"),
               read_json(path / "summary.json"))


def read_json(path: Path) -> dict:
    """A run folder's JSON file, or {} before it is written."""
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def list_runs(root: str | Path) -> list[Path]:
    """Run folders under root, oldest first (names start with a timestamp unless you named them)."""
    if not isinstance(root, (str, Path)):
        raise ConfigError(f"list_runs({root!r}): give the runs folder as a str or pathlib.Path, e.g. 'runs'")
    root = Path(root)
    if not root.exists():
        return []
    runs = [p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and (p / "config.json").exists()]
    return sorted(runs, key=lambda p: (p / "config.json").stat().st_mtime)


def write_jsonl(path: Path, rows: list[dict], mode: str = "w") -> None:
    with open(path, mode, encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
