"""Turn one output of bench/throughput.py from before run files (its --out JSON: gpu, driver, date, versions, command,
workloads) into a run file (bench/run_file.py's format), the output itself kept under bench/results/raw/.

    python bench/adopt_throughput_output.py bench/results/raw/throughput-gains-2026-12-05.json --kind lever-gains \
        --commit da416fb
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from run_file import FORMAT, RUNS  # noqa: E402


def adopt(raw: Path, kind: str, commit: str) -> Path:
    data = json.loads(raw.read_text(encoding="utf-8"))
    results = {k: data[k] for k in ("budget_gib", "model", "warmup_steps", "workloads") if k in data}
    run = {"format": FORMAT, "kind": kind, "date": data["date"], "started": None, "command": data["command"],
           "environment": {}, "commit": commit, "machine": {"gpu": data["gpu"], "driver": data.get("driver")},
           "versions": data["versions"], "results": results,
           "migrated_from": {"file": raw.relative_to(ROOT).as_posix(), "records": [""],
                             "date_from": "the output's own date"}}
    path = RUNS / f"{data['date']}-{kind}-{raw.stem.split('-')[-1]}raw.json"
    path.write_text(json.dumps(run, indent=1) + "\n", encoding="utf-8")
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw", type=Path)
    parser.add_argument("--kind", required=True)
    parser.add_argument("--commit", required=True)
    args = parser.parse_args()
    print(adopt(args.raw.resolve(), args.kind, args.commit))
