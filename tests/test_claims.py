"""Claims the course makes, each checked against its source: a number in a notebook or a comment fails here when the
library, the planner constant or the arithmetic behind it says otherwise."""

import inspect
import json
import re

import pytest

from nb_helpers.config import PROJECT_ROOT
from nb_helpers.plan.adapter import BNB_8BIT_MIN_SIZE, BNB_BLOCK, BNB_PAGE_MIN_ELEMENTS, optimizer_bytes
from nb_helpers.plan.catalog import known_shape
from nb_helpers.plan.choose import GC_COMPUTE_FACTOR
from nb_helpers.plan.planner import ALL_LINEAR, QKVO, PlanInput, lora_tensors, plan

NOTEBOOKS = {p.name: p for p in sorted((PROJECT_ROOT / "notebooks").glob("*.ipynb"))}
COURSE = list(NOTEBOOKS)
WORDING_CHECKED = list(NOTEBOOKS)


def cells(name: str, kind: str | None = None) -> list[str]:
    """The sources of a notebook's cells (of one kind: "markdown" or "code")."""
    nb = json.loads(NOTEBOOKS[name].read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if kind is None or c["cell_type"] == kind]


# --- (a) bitsandbytes' optimizer: paging threshold, 8-bit threshold, block size ------------------------------------
def bnb_optimizer_source() -> str:
    from bitsandbytes.optim import optimizer

    return inspect.getsource(optimizer)


def test_paging_threshold_is_the_one_bitsandbytes_uses():
    """get_state_buffer pages a state only when `not self.is_paged or p.numel() < 1e5` is false."""
    from bitsandbytes.optim.optimizer import Optimizer8bit

    source = inspect.getsource(Optimizer8bit.get_state_buffer)
    found = re.findall(r"is_paged\s+or\s+p\.numel\(\)\s*<\s*([0-9][0-9_.eE+]*)", source)
    assert len(found) == 1, "bitsandbytes' paging test changed shape: read get_state_buffer again"
    assert float(found[0]) == BNB_PAGE_MIN_ELEMENTS


def test_8bit_threshold_and_block_are_bitsandbytes_own():
    from bitsandbytes.optim.optimizer import Optimizer2State

    assert inspect.signature(Optimizer2State.__init__).parameters["min_8bit_size"].default == BNB_8BIT_MIN_SIZE
    assert re.search(rf"\bblocksize\s*=\s*{BNB_BLOCK}\b", bnb_optimizer_source())


def test_r8_adapters_are_under_the_paging_threshold_and_counted_inside_the_allocator():
    """The recipe (TinyLlama, r=8, paged_adamw_8bit) pages nothing: its optimizer state is allocator memory."""
    shape = known_shape("tinyllama-1.1b")
    for targets, largest in ((QKVO, 16_384), (ALL_LINEAR, 45_056)):  # the sizes notebook 02 and the planner quote
        p = plan(shape, PlanInput(rank=8, targets=targets, optim="paged_adamw_8bit"))
        sizes = lora_tensors(shape, p.inputs)
        assert max(sizes) == largest < BNB_PAGE_MIN_ELEMENTS
        assert p.components["optimizer_paged"] == 0
        assert p.components["optimizer"] == optimizer_bytes(sizes, "paged_adamw_8bit", 2) > 0


def test_only_moments_of_tensors_over_the_threshold_are_counted_as_paged():
    """r=64 on every linear layer of TinyLlama: the MLP's 5,632-wide tensors (360,448 values) are paged, the rest not;
    the absmax of each block is a plain allocation either way."""
    shape = known_shape("tinyllama-1.1b")
    inp = PlanInput(rank=64, targets=ALL_LINEAR, optim="paged_adamw_8bit")
    p = plan(shape, inp)
    sizes = lora_tensors(shape, p.inputs)
    big = [n for n in sizes if n >= BNB_PAGE_MIN_ELEMENTS]
    assert big and len(big) < len(sizes)
    assert p.components["optimizer_paged"] == 2 * sum(big)  # two uint8 moments
    assert p.components["optimizer"] + p.components["optimizer_paged"] == optimizer_bytes(sizes, inp.optim, 2)
    unpaged = plan(shape, PlanInput(rank=64, targets=ALL_LINEAR, optim="adamw_8bit")).components
    assert unpaged["optimizer_paged"] == 0 and unpaged["optimizer"] == optimizer_bytes(sizes, "adamw_8bit", 2)


# --- (b) the one figure for gradient checkpointing's cost --------------------------------------------------------
GC_PERCENT = round((GC_COMPUTE_FACTOR - 1) * 100)
MORE_COMPUTE = re.compile(r"(\d+)\s*%\s*more compute")


@pytest.mark.parametrize("name", COURSE)
def test_checkpointing_cost_quoted_is_the_planner_constant(name):
    """Any "N% more compute" in a notebook is GC_COMPUTE_FACTOR's figure (measured per-step costs are labelled as
    measurements and worded otherwise)."""
    quoted = [int(n) for text in cells(name) for n in MORE_COMPUTE.findall(text)]
    assert all(n == GC_PERCENT for n in quoted), f"{name} quotes {quoted}% more compute; the planner says {GC_PERCENT}%"


def test_checkpointing_cost_is_stated_in_the_course_and_the_config():
    assert any(MORE_COMPUTE.search(text) for text in cells("00_environment_check.ipynb", "markdown"))
    config = (PROJECT_ROOT / "nb_helpers" / "config.py").read_text(encoding="utf-8")
    assert [int(n) for n in MORE_COMPUTE.findall(config)] == [GC_PERCENT]


# --- (c) paging and loss scaling, said right ---------------------------------------------------------------------
WRONG_MECHANISMS = [
    re.compile(r"paged to (the )?host|spills? to (the )?host", re.I),  # paging moves nothing at r=8 (see (a))
    re.compile(r"loss scal[^.\n]*\b(prevent\w*|against|avoid\w*)\s+(an?\s+)?(fp16\s+)?overflow", re.I),  # underflow
    re.compile(r"loss scal[^.\n]*keeps? it stable", re.I),
]


@pytest.mark.parametrize("name", WORDING_CHECKED)
def test_no_notebook_misstates_paging_or_loss_scaling(name):
    for text in cells(name):
        for wrong in WRONG_MECHANISMS:
            assert not wrong.search(text), f"{name}: {wrong.search(text).group(0)!r}"


def test_the_package_does_not_misstate_paging_or_loss_scaling():
    for path in (PROJECT_ROOT / "nb_helpers").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for wrong in WRONG_MECHANISMS:
            assert not wrong.search(text), f"{path.relative_to(PROJECT_ROOT)}: {wrong.search(text).group(0)!r}"


# --- (d) learner text names machines and dates, not our bookkeeping ----------------------------------------------
HASH = r"`?(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b`?"  # a commit hash: hex, with digits and letters
BOOKKEEPING = [
    re.compile(r"\b(device\s+)?calls?\s+\d+", re.I),  # "device call 17", "call 24", "calls 15-16"
    re.compile(r"\bissues?\s+#?\d+", re.I),
    re.compile(r"\bcommits?\b[^.\n]{0,30}?" + HASH, re.I),  # "commit 59b4ead", "at commit `f763314`"
    re.compile(r"\b(at|@)\s+" + HASH),  # "at 59b4ead"
]


@pytest.mark.parametrize("name", WORDING_CHECKED)
def test_learner_text_has_no_call_numbers_issue_numbers_or_commit_hashes(name):
    for text in cells(name, "markdown"):
        for pattern in BOOKKEEPING:
            assert not pattern.search(text), f"{name}: {pattern.search(text).group(0)!r}"


# --- numbers computed from parameter counts ----------------------------------------------------------------------
def test_lm_head_adapter_size_quoted_in_02():
    shape = known_shape("tinyllama-1.1b")
    params = 8 * (shape.hidden + shape.vocab)  # r x (in + out)
    text = " ".join(cells("02_attach_lora.ipynb", "markdown"))
    assert f"8 × ({shape.hidden:,} + {shape.vocab:,}) ≈ {params / 1e6:.2f} M" in text


def test_host_ram_estimates_quoted_in_05():
    """fp32 is 4 bytes a weight and Q8_0 8.5 bits: the GB figures in notebook 05 follow from the parameter counts."""
    text = " ".join(cells("05_try_the_model.ipynb", "markdown"))
    for billions, name in ((0.135, "the embedded model"), (1.1, "TinyLlama")):
        assert f"{billions * 4:.2g} GB for {name}" in text
    assert f"about {1.1 * 8.5 / 8:.2g} GB (1.1 billion weights × 8.5 bits)" in text