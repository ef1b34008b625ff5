"""Run once: the aggregates bench/results/*.json, kept by hand until then, into one run file per measured run
(bench/run_file.py's format) under bench/results/runs/. Kept in the repository as the record of how those files
were made; git keeps the aggregates it read.

    python bench/split_results.py            # writes the run files, prints what came from where
    python bench/split_results.py --check    # only says how many files it would write

It ran once; the aggregates were deleted right after (git keeps them).

throughput.json held one record per device call in several places: its top level and `earlier` (whole
bench/throughput.py outputs, some joining two calls: split by the call each workload names), `spread` (the
reference's and our tokens/s per call), `turing` (the GTX 1650 card emulated), and a section per piece of work with
each call's runs and each lever's with/without pairs. Every record is routed to the call its key names; one file per
call holds them: `results.workloads` (bench/throughput.py's own layout, run by run) and `results.summaries` (the
rest, under the section names they had, the call labels taken out of the keys). Texts go to `notes`, to each call
they name, or to every call of their section. The date is the record's own, else that of the call's raw output
(bench/results/raw/throughput-callN*.json), else the day git first held the record. The other aggregates are
one run each (planner_validation.json and step_time.json are reports, one run of their script each).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from run_file import FORMAT, RESULTS, RUNS  # noqa: E402

RAW = RESULTS / "raw"
WORKLOADS = ("w512", "w2048", "shipped")
CALL = re.compile(r"(?<![A-Za-z])(?:device\s+)?calls?[\s_-]*(\d+)(?:\s*(?:-|–|\.\.)\s*(\d+)(?![0-9a-fA-F]))?", re.I)
HASH = re.compile(r"(?<![0-9a-zA-Z])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7}(?![0-9a-zA-Z])")
THROUGHPUT = "bench/results/throughput.json"


# --- helpers ------------------------------------------------------------------------------------------------------
def key_calls(key: str) -> list[int]:
    """The call a key is about: its first call label ("call37 93ad4e3 (right after call 36)" -> [37])."""
    m = CALL.search(key)
    return calls_in(m.group(0)) if m else []


def calls_in(text: str) -> list[int]:
    found = []
    for m in CALL.finditer(text):
        first, last = int(m.group(1)), int(m.group(2) or m.group(1))
        found += range(first, last + 1) if first <= last <= first + 80 else [first]
    return list(dict.fromkeys(found))


def clean(key: str) -> str:
    """A key without its call label and commit: "call35 358a82c second pair" -> "second pair"."""
    text = HASH.sub("", CALL.sub("", key))
    text = re.sub(r"\(\s*\)", "", text)
    text = re.sub(r"\(\s+", "(", re.sub(r"\s+\)", ")", re.sub(r"\s+", " ", text))).strip(" -_+,;")
    if text.startswith("(") and text.endswith(")") and text.count("(") == 1:
        text = text[1:-1].strip()
    return text


def deep_clean(node, keep_call: int | None = None):
    """Keys without call labels, all the way down (the values, figures and words, unchanged)."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            named = key_calls(key)
            assert not named or named == [keep_call] or keep_call is None, (key, keep_call)
            new = clean(key) if named or HASH.search(key) else key
            new = new or "this run"
            while new in out:
                new += " (again)"
            out[new] = deep_clean(value, keep_call)
        return out
    if isinstance(node, list):
        return [deep_clean(v, keep_call) for v in node]
    return node


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()


def last_commit_date(path: str) -> str:
    return git("log", "-1", "--format=%cs", "--", path)


def first_seen(label: str, path: str = THROUGHPUT) -> str | None:
    """The day git first held `label` in `path`: when the record was written, right after its run."""
    dates = git("log", "--reverse", "--format=%cs", "-S", label, "--", path).splitlines()
    return dates[0] if dates else None


def raw_runs() -> dict[int, list[dict]]:
    """bench/throughput.py's own outputs per call (bench/results/raw/throughput-callN*.json): date, command, driver,
    versions. call3-throughput-shipped.json and the multi-GPU session's files are another numbering: left out."""
    found: dict[int, list[dict]] = {}
    for path in sorted(RAW.glob("*.json")):
        name = path.name
        if not (name.startswith("throughput-") or name.startswith("call4-throughput")):
            continue
        calls = calls_in(name.replace("throughput-turing", "throughput"))
        if not calls:
            continue
        data = json.loads(path.read_text())
        found.setdefault(calls[0], []).append({"file": f"bench/results/raw/{name}", **{
            k: data.get(k) for k in ("date", "command", "driver", "versions", "gpu")}})
    return found


def same_figures(workloads: dict) -> dict | None:
    """The raw bench/throughput.py output whose runs hold these very tokens/s figures (floats to the last digit)."""
    ours = {r.get("tokens_per_s") for w in workloads.values() for r in (w.get("runs") or {}).values()
            if isinstance(r, dict) and isinstance(r.get("tokens_per_s"), float)}
    for path in sorted(RAW.glob("*throughput*.json")):
        data = json.loads(path.read_text())
        theirs = {r.get("tokens_per_s") for w in (data.get("workloads") or {}).values()
                  for r in (w.get("runs") or {}).values() if isinstance(r, dict)}
        if ours and ours & theirs:
            return {"file": f"bench/results/raw/{path.name}", **{k: data.get(k) for k in ("command", "driver",
                                                                                          "versions")}}
    return None


def raw_commits() -> dict[int, str]:
    """The commit a raw file of a call names (bench/results/raw/pytest-gpu-8491fc9-call73.log): where a record
    names none."""
    found: dict[int, str] = {}
    for path in sorted(RAW.iterdir()):
        calls, hashes = calls_in(path.name), HASH.findall(path.name.replace("_", "-"))
        if len(calls) == 1 and len(hashes) == 1 and not path.name.startswith(("call1", "call2", "call3")):
            found.setdefault(calls[0], hashes[0])
    return found


# --- throughput.json ----------------------------------------------------------------------------------------------
def runs_like(node: dict) -> bool:
    """{run name: its record} as bench/throughput.py writes a workload's runs (a run not run: a string)."""
    runs = {k: v for k, v in node.items() if isinstance(v, (dict, str))}
    extra = [k for k in node if k not in runs]  # "ours_step_s_all": a field of run "ours" beside it
    return bool(runs) and all(k.split("_")[0] in runs for k in extra) and any(
        isinstance(v, dict) and ("tokens_per_s" in v or "micro_batch" in v) for v in runs.values())


class Call:
    """Everything throughput.json recorded about one device call (or one run without a call number)."""

    def __init__(self, key):
        self.key = key
        self.workloads: dict = {}
        self.summaries: dict = {}
        self.notes: list[str] = []
        self.commands: list[str] = []
        self.mentioned_commands: list[str] = []
        self.records: list[str] = []
        self.header: dict = {}
        self.date = self.date_from = self.commit = self.versions = self.driver = None

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def set_commit(self, commit: str | None) -> None:
        if commit and not self.commit:
            self.commit = commit

    def add_runs(self, workload: str, entry: dict, path: list[str]) -> None:
        """bench/throughput.py's layout: workloads[w]["runs"][name] = the run's record."""
        runs = entry.get("runs", entry) if isinstance(entry, dict) else {}
        target = self.workloads.setdefault(workload, {})
        for key in ("seq", "effective_batch"):
            if key in entry:
                target[key] = entry[key]
        for key in ("plain_vs_reference",):
            if entry.get(key) is not None:
                target[key] = entry[key]
        if "runs" in entry:  # the rest of a workload's entry: words to notes, figures beside the runs
            for key, value in entry.items():
                if key in ("runs", "seq", "effective_batch", "plain_vs_reference", "reference", "ours"):
                    continue
                if isinstance(value, str):
                    self.note(f"{workload}: {value}")
                else:
                    self.put([*path, workload, key], value)
        fields = {k: v for k, v in runs.items() if not isinstance(v, (dict, str))}
        runs = {k: v for k, v in runs.items() if k not in fields}
        for key, value in fields.items():  # "ours_step_s_all" -> runs["ours"]["step_s_all"]
            name, field = key.split("_", 1)
            runs[name] = {**runs[name], field: value}
        for name, record in runs.items():
            record = {"not_run": record} if isinstance(record, str) else deep_clean(record, self.number)
            have = target.setdefault("runs", {}).get(name)
            if have is None or have == record:
                target["runs"][name] = record
            else:  # the same run recorded twice, differently: the second goes beside it
                self.put([*path, workload, name], record)

    def put(self, path: list[str], value) -> None:
        path = [p for p in path if p]
        node = self.summaries
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {} if part not in node else {"value": node[part]}
            node = node[part]
        last = path[-1] if path else "value"
        value = deep_clean(value, self.number)
        while last in node and node[last] != value:
            if isinstance(node[last], dict) and isinstance(value, dict) and not set(node[last]) & set(value):
                node[last] = {**node[last], **value}
                return
            last += " (again)"
        node[last] = value

    @property
    def number(self):
        return self.key if isinstance(self.key, int) else None


class Throughput:
    def __init__(self, data: dict):
        self.data = data
        self.calls: dict = {}
        self.raw = raw_runs()
        self.raw_commits = raw_commits()
        self.unplaced: list[str] = []

    def call(self, key) -> Call:
        return self.calls.setdefault(key, Call(key))

    # whole bench/throughput.py outputs, one or two calls each ------------------------------------------------
    def full_record(self, record: dict, where: str, date: str | None = None) -> list[Call]:
        """Split by the call (or commit) measured_at_commit names for each workload."""
        at = record.get("measured_at_commit") or {}
        parts: dict = {}
        for workload, entry in record["workloads"].items():
            label = at.get(workload, "") if isinstance(at, dict) else str(at)
            named = [int(n) for n in re.findall(r"device call (\d+)", label)]
            key = named[0] if named else (HASH.findall(label) or [where])[0]
            call = self.call(key)
            call.add_runs(workload, entry, [])
            call.records.append(f"{where}/workloads/{workload}".lstrip("/"))
            call.set_commit((HASH.findall(label) or [None])[0])
            if label:
                call.header.setdefault("measured_at", {})[workload] = label
            when = re.search(r"\d{4}-\d\d-\d\d", label)
            if when and not call.date:
                call.date, call.date_from = when.group(0), "record"
            parts.setdefault(key, []).append(workload)
        for key, workloads in parts.items():
            call = self.call(key)
            for field in ("gpu", "budget_gib", "model", "warmup_steps"):
                if field in record:
                    call.header[field] = record[field]
            if record.get("versions") and not call.versions:
                call.versions = record["versions"]
            if record.get("driver") and not call.driver:
                call.driver = record["driver"]
            if (record.get("date") or date) and not call.date:
                call.date, call.date_from = record.get("date") or date, "record"
            for text in record.get("notes") or []:
                call.note(text)
            command = record.get("command")
            if isinstance(command, str):
                call.commands.append(command)
            elif isinstance(command, list):
                call.commands += [c for c in command if calls_in(c)[:1] in ([key], [])] or command
            elif isinstance(command, dict):  # {"w512, shipped": ..., "w2048": ...}
                call.commands += [c for names, c in command.items()
                                  if set(re.findall(r"w512|w2048|shipped", names)) & set(workloads)]
        return [self.call(k) for k in parts]

    # everything else: routed by the call each key names ----------------------------------------------------------
    def route(self, node, path: list[str], as_runs: bool, range_calls: list[int] | None = None,
              where: str = "", root: bool = False) -> set:
        reached: set = set()
        texts: list[tuple[str, str, bool]] = []
        for key, value in node.items():
            named = key_calls(key)
            here = f"{where}/{key}"
            if len(named) == 1:
                call = self.call(named[0])
                self.absorb(call, value, [*path, clean(key)], as_runs, here)
                call.set_commit((HASH.findall(key) or [None])[0])
                reached.add(call.key)
            elif named:  # a range: its children name their calls, or are split by workload
                if isinstance(value, dict):
                    reached |= self.route(value, [*path, clean(key)], as_runs, named, here)
                else:
                    texts.append((f"{' / '.join([*path, clean(key)])}", value, False))
            elif range_calls and key.split(" ")[0] in WORKLOADS:
                owners = [c for c in range_calls if key.split(" ")[0] in self.call(c).workloads] or range_calls
                for c in owners:
                    self.absorb(self.call(c), {key: value}, path, as_runs, here)
                    reached.add(c)
            elif isinstance(value, dict):
                reached |= self.route(value, [*path, key], as_runs, range_calls, here)
            else:
                texts.append((" / ".join([*path, key]), value, key.startswith("_") and not root))
        for label, value, section_wide in texts:  # after the data: words go where the figures went
            for text in value if isinstance(value, list) else [value]:
                text = text if isinstance(text, str) else json.dumps(text)
                named = [c for c in calls_in(text) if c in self.calls]
                targets = sorted(reached, key=str) if section_wide or not named else named
                if not targets and range_calls:
                    targets = range_calls
                if not targets:
                    self.unplaced.append(f"{label}: {text}")
                for c in targets:
                    if label.endswith("commands"):
                        self.call(c).mentioned_commands.append(text)
                    else:
                        self.call(c).note(f"{label}: {text}" if label else text)
        return reached

    def absorb(self, call: Call, value, path: list[str], as_runs: bool, where: str) -> None:
        call.records.append(where.lstrip("/"))
        if as_runs and path and path[-1] in WORKLOADS and isinstance(value, dict) and runs_like(value):
            call.add_runs(path[-1], value, path[:-1])
            return
        if not isinstance(value, dict):
            call.put(path, value)
            return
        for key, child in value.items():
            name = clean(key) if calls_in(key) or HASH.search(key) else key
            workload = name.split(" ")[0] if name.endswith("gtx1650 card") else name  # runs named for the card
            if as_runs and workload in WORKLOADS and isinstance(child, dict) and runs_like(child):
                call.add_runs(workload, child, path)
            elif key == "_versions":
                call.versions = call.versions or child
            elif key in ("_what", "_note", "note") and isinstance(child, str):
                call.note(f"{' / '.join(p for p in path if p)}: {child}" if any(path) else child)
            else:
                call.put([*path, name], child)

    def spread(self, node: dict) -> None:
        """[reference tokens/s, our tokens/s] per workload and call, as named figures."""
        fmt = node.get("_format", "")
        named = {}
        for key, value in node.items():
            if key == "_format":
                continue
            named[key] = {w: {"reference_tokens_per_s": pair[0], "ours_tokens_per_s": pair[1]}
                          if isinstance(pair, list) else pair for w, pair in value.items()}
        reached = self.route(named, ["tokens per second, reference and ours"], False, where="spread")
        for c in reached:
            mentioned = [n for n in calls_in(fmt) if n in self.calls]
            if not mentioned or c in mentioned:
                self.call(c).note(f"tokens per second, reference and ours: {fmt}")

    def run(self) -> list[Call]:
        d = self.data
        top = {k: d[k] for k in ("gpu", "date", "versions", "budget_gib", "model", "warmup_steps", "driver",
                                 "command", "workloads", "measured_at_commit", "notes")}
        self.full_record(top, "")
        for key, record in d["earlier"].items():
            if key == "2026-11-30":
                self.first_day(record)
            else:
                self.full_record(record, f"earlier/{key}")
        self.spread(d["spread"])
        self.route(d["turing"], ["GTX 1650 card emulated"], True, where="turing", root=True)
        self.route(d["issue27"]["calls"], ["runs"], True, where="issue27/calls")
        rest = {k: v for k, v in d["issue27"].items() if k != "calls"}
        self.route(rest, [], False, where="issue27", root=True)
        return self.finish()

    def first_day(self, record: dict) -> None:
        """earlier["2026-11-30"]: w512 and w2048 at b121a9f, the shipped data at 5c70b73 (another host's numbering),
        a repeat at 2570dcc (call 4), and the shipped data before the fused QLoRA layers."""
        parts = self.full_record({k: v for k, v in record.items() if k in ("workloads", "measured_at_commit",
                                                                          "notes")}, "earlier/2026-11-30",
                                 date="2026-11-30")
        for call in parts:
            call.header.setdefault("gpu", self.data["gpu"])
        shipped = self.call("5c70b73")
        shipped.date, shipped.date_from = "2026-11-30", "record"
        first_raw = json.loads((RAW / "call3-throughput-shipped.json").read_text())
        shipped.commands.append(first_raw["command"])
        shipped.driver, shipped.versions = first_raw.get("driver"), first_raw.get("versions")
        shipped.note("raw output: bench/results/raw/call3-throughput-shipped.json (a 2 x H200 host, GPU 0 alone)")
        repeat = record["repeat_2570dcc"]
        call = self.call(4)
        for workload, runs in repeat["workloads"].items():
            call.add_runs(workload, runs, [])
        call.commands.append(repeat["command"])
        call.note(repeat["note"])
        call.set_commit("2570dcc")
        call.records.append("earlier/2026-11-30/repeat_2570dcc")
        before = self.call("before fused QLoRA layers")
        for workload, entry in record["earlier"].items():
            before.add_runs("shipped", entry, [])
        before.records.append("earlier/2026-11-30/earlier/shipped_before_fused_lora")
        before.note("the shipped data measured in the session before the fused QLoRA layers (13.96x), "
                    "recorded under the first day's results")
        before.note(f"measured at: {record['measured_at_commit']['shipped_before_fused_lora']}")
        before.commands.append("python bench/throughput.py --workloads shipped")
        before.header.update(raw_outputs=["bench/results/raw/throughput-shipped-call4.log"],
                             command_from="not recorded: its raw log shows bench/throughput.py's two shipped-data "
                                          "runs (reference, ours) and nothing else")
        date = first_seen('"shipped_before_fused_lora"')
        before.date, before.date_from = date, "git: the day the record was first committed"

    def finish(self) -> list[Call]:
        for call in self.calls.values():
            raw = self.raw.get(call.number) if call.number is not None else None
            if call.key == 4:
                raw = [r for r in raw or [] if "2570dcc" in r["file"]] or raw
            if raw:
                call.header.setdefault("raw_outputs", [r["file"] for r in raw])
                if not call.date:
                    call.date, call.date_from = raw[0]["date"], "raw output"
                if not call.commands:
                    call.commands = [r["command"] for r in raw if r.get("command")]
                call.driver = call.driver or raw[0].get("driver")
                call.versions = call.versions or raw[0].get("versions")
            if not call.commit and call.number in self.raw_commits:
                call.commit = self.raw_commits[call.number]
                call.header["commit_from"] = "the name of a raw file of the same call"
            if not call.commands:  # a record without its call's number: the raw output holding its very figures
                found = same_figures(call.workloads)
                if found:
                    call.commands = [found["command"]]
                    call.driver, call.versions = call.driver or found.get("driver"), call.versions or found.get(
                        "versions")
                    call.header.setdefault("raw_outputs", [found["file"]])
                    call.header["command_from"] = "the raw output holding the same figures"
            if not call.commands and call.mentioned_commands:
                call.commands = call.mentioned_commands
            else:
                for text in call.mentioned_commands:
                    call.note(f"commands, as the record summarised them: {text}")
            if not call.date:
                label = next((r.rsplit("/", 1)[-1] for r in call.records if calls_in(r.rsplit("/", 1)[-1])), None)
                date = first_seen(json.dumps(label)) if label else None
                call.date, call.date_from = (date, "git: the day the record was first committed") if date else (
                    last_commit_date(THROUGHPUT), "git: the file's last commit")
            call.header.setdefault("gpu", self.data["gpu"])
        return sorted(self.calls.values(), key=lambda c: (c.date, c.number if c.number is not None else 0,
                                                          str(c.key)))


def throughput_runs() -> tuple[list[dict], list[str]]:
    data = json.loads((RESULTS / "throughput.json").read_text())
    out = []
    split = Throughput(data)
    for call in split.run():
        results = {k: call.header[k] for k in ("budget_gib", "model", "warmup_steps") if k in call.header}
        if call.workloads:
            results["workloads"] = call.workloads
        if call.summaries:
            results["summaries"] = call.summaries
        command = list(dict.fromkeys(call.commands))
        out.append(dict(
            kind="throughput", date=call.date, command=command[0] if len(command) == 1 else command or None,
            commit=call.commit, machine={"gpu": call.header["gpu"], "gpu_count": 1, "driver": call.driver},
            versions=call.versions, results=results, notes=call.notes,
            migrated_from={"file": THROUGHPUT, "records": list(dict.fromkeys(call.records)),
                           "date_from": call.date_from, "raw_outputs": call.header.get("raw_outputs", []),
                           **{k: call.header[k] for k in ("commit_from", "command_from", "measured_at")
                              if k in call.header}},
            order=call.number or 0))
    return out, split.unplaced


# --- the other aggregates: one run each ---------------------------------------------------------------------------
def other_runs() -> list[dict]:
    def load(name):
        return json.loads((RESULTS / name).read_text())

    def migrated(name, date_from="record"):
        return {"file": f"bench/results/{name}", "records": [""], "date_from": date_from}

    out = []
    levers = load("throughput-levers.json")
    out.append(dict(kind="throughput", date=levers["date"], command=levers["command"],
                    commit=levers["measured_at_commit"],
                    machine={"gpu": levers["gpu"], "gpu_count": 1, "driver": levers["driver"]},
                    versions=levers["versions"],
                    results={k: levers[k] for k in ("budget_gib", "model", "warmup_steps", "workloads")},
                    notes=levers["notes"], migrated_from=migrated("throughput-levers.json"), order=2))

    cpu = load("cpu.json")
    out.append(dict(kind="cpu", date=cpu["date"], command="python bench/cpu_bench.py --steps 6", commit=None,
                    machine={"cpu": cpu["cpu"], "cores": cpu["cores"], "arch": "x86_64"}, versions=cpu["versions"],
                    results={k: cpu[k] for k in ("profile", "steps", "isa_limits", "rows")},
                    notes=["The aggregate recorded no command: bench/cpu_bench.py's full grid (both ISA limits) at 6 "
                           "steps per variant, as the commit that wrote it says."],
                    migrated_from=migrated("cpu.json")))

    for name in ("multi_gpu.json", "multi_gpu-w2048.json"):
        m = load(name)
        out.append(dict(kind="multi-gpu", date=m["date"], command=m["command"], commit=None,
                        machine={"gpu": m["gpu"], "gpu_count": m["gpu_count"], "driver": m["driver"],
                                 "topology": m["topology"]}, versions=m["versions"],
                        results={k: v for k, v in m.items() if k not in ("gpu", "gpu_count", "driver", "topology",
                                                                         "date", "versions", "command")},
                        notes=[], migrated_from=migrated(name)))

    reach = load("reach.json")
    out.append(dict(kind="reach", date=reach["date"], command=reach["command"], commit="2d5957f",
                    machine={"gpu": reach["gpu"], "gpu_count": 1, "driver": None}, versions=reach["versions"],
                    results={k: reach[k] for k in ("budget_gib", "points", "predicted_with")},
                    notes=[reach["offload_overlap_note"]], migrated_from=migrated("reach.json")))

    rep = load("reproducibility.json")
    out.append(dict(kind="reproducibility", date=rep["date"], command="python bench/reproducibility.py",
                    commit=None, machine={"cpu": rep["cpu"], "cores": rep["cores"], "arch": rep["machine"]},
                    versions=rep["versions"], results={"train_command": rep["command"], "pairs": rep["pairs"]},
                    notes=["The aggregate recorded each run's training command, not the bench's: "
                           "bench/reproducibility.py's default (every variant) made these five pairs."],
                    migrated_from=migrated("reproducibility.json")))

    points = load("planner_validation.json")
    out.append(dict(kind="planner-validation", date=last_commit_date("bench/results/planner_validation.json"),
                    command="python bench/planner_report.py", commit=None, machine=None, versions=None,
                    results={"measured_on": "NVIDIA H200", "points": points},
                    notes=["A report: the planner's prediction beside every committed H200 measurement."],
                    migrated_from=migrated("planner_validation.json", "git: the file's last commit")))

    cpu_plan = load("planner_from_cpu.json")
    out.append(dict(kind="planner-from-cpu", date=last_commit_date("bench/results/planner_from_cpu.json"),
                    command=cpu_plan["command"], commit=None, machine=None, versions=None,
                    results={k: v for k, v in cpu_plan.items() if k != "command"},
                    notes=["A report: the H200 points planned on a machine without the GPU."],
                    migrated_from=migrated("planner_from_cpu.json", "git: the file's last commit")))

    step = load("step_time.json")
    out.append(dict(kind="step-time-model", date=last_commit_date("bench/results/step_time.json"),
                    command=step["command"], commit=None, machine=None, versions=None,
                    results={k: v for k, v in step.items() if k != "command"},
                    notes=["A report: the time model (nb_helpers/plan/step_time.py) against the H200's measured "
                           "step and GPU-busy times."],
                    migrated_from=migrated("step_time.json", "git: the file's last commit")))
    return out


def write(runs: list[dict], out_dir: Path, check: bool) -> list[Path]:
    counters: dict = {}
    written = []
    by_day: dict = {}
    for run in runs:
        by_day.setdefault((run["date"], run["kind"]), []).append(run)
    for (date, kind), group in sorted(by_day.items()):
        group.sort(key=lambda r: r.get("order", 0))  # stable: throughput.json's calls stay in their order
        for run in group:
            counters[(date, kind)] = counters.get((date, kind), 0) + 1
            path = out_dir / f"{date}-{kind}-h{counters[(date, kind)]:02d}.json"
            data = {"format": FORMAT, "kind": kind, "date": date, "started": None, "command": run["command"],
                    "environment": None, "commit": run["commit"], "machine": run["machine"],
                    "versions": run["versions"], "results": run["results"]}
            if run.get("notes"):
                data["notes"] = run["notes"]
            data["migrated_from"] = run["migrated_from"]
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
            written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default=str(RUNS))
    parser.add_argument("--check", action="store_true", help="write nothing, print what would be written")
    args = parser.parse_args()
    if not (RESULTS / "throughput.json").exists():
        sys.exit("the aggregates were split into bench/results/runs/ and deleted; git keeps them: check "
                 "bench/results/*.json out from the commit before the one that deleted them to run this again")
    tp, unplaced = throughput_runs()
    # the order within a day: throughput.json's calls by number, the lever runs (call 2 of their day) among them
    runs = tp + other_runs()
    for text in unplaced:
        print(f"not placed (a text naming no call, in a section without runs): {text[:200]}")
    written = write(runs, Path(args.out_dir), args.check)
    counts: dict = {}
    for run in runs:
        counts[run["migrated_from"]["file"]] = counts.get(run["migrated_from"]["file"], 0) + 1
    for name, n in counts.items():
        print(f"{name}: {n} run file{'s' * (n != 1)}")
    print(f"{len(written)} files {'would be ' if args.check else ''}written to {args.out_dir}")


if __name__ == "__main__":
    main()
