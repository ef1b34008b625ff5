"""Checks executed notebooks (make test-notebooks runs them with nbmake on a scratch copy and keeps their outputs):
no cell may write to stderr or end in an error. A warning in pink under a cell is noise a learner has to read past,
or a real problem hidden in noise. Exits 1 and names each cell otherwise.

    python tests/notebook_outputs.py runs/ci/executed
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def problems(path: Path) -> list[str]:
    found = []
    for index, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error" or output.get("name") == "stderr":
                text = "".join(output.get("text", "")) or f"{output.get('ename')}: {output.get('evalue')}"
                found.append(f"{path.name} cell {index}: {text.strip()[:300]}")
    return found


def main(folder: str) -> int:
    paths = sorted(Path(folder).glob("*.ipynb"))
    if not paths:
        print(f"no executed notebooks in {folder}", file=sys.stderr)
        return 1
    found = [line for path in paths for line in problems(path)]
    print("\n".join(found) if found else f"{len(paths)} notebooks: no stderr output, no error")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
