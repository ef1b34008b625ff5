"""The Layout block (docs/layout.md, linked from the README) names every module of nb_helpers where it lives."""

import re

from nb_helpers.config import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "nb_helpers"
LAYOUT = PROJECT_ROOT / "docs" / "layout.md"


def layout_block() -> str:
    return LAYOUT.read_text(encoding="utf-8").split("```\n", 2)[1]


def listed(block: str) -> dict[str, set[str]]:
    """{folder: names} from the block. A row "  a, b   description" names top-level modules a and b; a row
    "  sub/   text" and the deeper-indented lines under it name sub's modules anywhere in their text."""
    found: dict[str, set[str]] = {"": set()}
    folder = None
    for line in block.split("\n"):
        if line.startswith("  ") and line[2:3] not in (" ", ""):
            head, _, text = line.strip().partition("  ")
            if head.endswith("/"):
                folder = head[:-1]
                found[folder] = set(re.findall(r"[a-z_0-9]+", text))
            else:
                folder = None
                found[""] |= {name.strip() for name in head.split(",")}
        elif line.startswith("   ") and folder is not None:
            found[folder] |= set(re.findall(r"[a-z_0-9]+", line))
        else:
            folder = None
    return found


def test_the_layout_names_every_module_where_it_lives():
    block = layout_block()
    names = listed(block)
    top = {p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("__")}
    assert top == names[""], f"top level: in the tree, not docs/layout.md {top - names['']}; gone {names[''] - top}"
    for sub in sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()):
        modules = {p.stem for p in (PACKAGE / sub).glob("*.py") if not p.stem.startswith("__")}
        assert sub in names, f"nb_helpers/{sub}/ is not in docs/layout.md"
        missing = modules - names[sub]
        assert not missing, f"nb_helpers/{sub}/: {sorted(missing)} not named in docs/layout.md"


def test_the_layout_check_notices_a_missing_module():
    block = layout_block().replace("  lora  ", "  lorax ")
    assert "lora" not in listed(block)[""]


def test_the_readme_links_the_layout():
    assert "`docs/layout.md`" in (PROJECT_ROOT / "README.md").read_text(encoding="utf-8")
