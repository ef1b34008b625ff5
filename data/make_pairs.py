"""Build the shipped preference pairs (notebook 07) from the shipped SFT rows: for every row, the chosen answer is its
correct JSON and the rejected one the same JSON with one realistic mistake (a value in the wrong field, a misspelt
value, a wrong quantity, a value the order never named, a key dropped or invented, prose around the JSON), the kinds
in equal shares. nb_helpers/pairs.py says why each kind.

Run from the repository root:  python data/make_pairs.py
The output is deterministic (fixed seed, nb_helpers.pairs.PAIRS_SEED): re-running it reproduces the committed files,
and tests/test_preference.py checks that it does.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from nb_helpers.pairs import write_pairs  # noqa: E402

SPLITS = {"train.jsonl": "pairs_train.jsonl", "eval.jsonl": "pairs_eval.jsonl"}


def main(data_dir: Path = HERE) -> None:
    for source, target in SPLITS.items():
        count = write_pairs(data_dir / source, data_dir / target)
        print(f"wrote {count} pairs to {data_dir / target}")


if __name__ == "__main__":
    main()
