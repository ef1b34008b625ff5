"""Fixtures of the browser suite: one scratch copy of the course, one JupyterLab server, one Chromium, shared by
the whole flow (02 -> 03 -> 04 -> reopen), as a person walks it."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from lab import (CHROMIUM_FLAGS, REQUIRED_ENV, LabServer, chromium_path, copy_project,  # noqa: E402
                 discard_open_notebooks, missing_requirement)

from nb_helpers.config import PROJECT_ROOT  # noqa: E402

SCREENSHOTS = PROJECT_ROOT / "runs" / "browser"  # runs/ is git-ignored


def playwright_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("playwright") is None


# Without Playwright the suite's modules cannot even be imported: leave them out and say why in one line (the report
# header), unless CI requires the suite, where the import error is the failure it should be.
collect_ignore_glob = ["test_*.py"] if playwright_missing() and not os.environ.get(REQUIRED_ENV) else []


def pytest_report_header(config):
    return missing_requirement()


def pytest_collection_modifyitems(config, items):
    reason = missing_requirement()
    browser_items = [i for i in items if "tests/browser" in str(i.fspath).replace(os.sep, "/")]
    if reason is None or not browser_items:
        return
    if os.environ.get(REQUIRED_ENV):
        raise pytest.UsageError(f"{reason} ({REQUIRED_ENV} is set, so the suite must run)")
    skip = pytest.mark.skip(reason=reason)
    for item in browser_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def scratch():
    """Not pytest's tmp_path: pytest prunes old basetemp folders at start-up, which another pytest session on the
    same machine could do to this one's live server and kernels."""
    folder = Path(tempfile.mkdtemp(prefix="nb-browser-"))
    yield folder
    log = folder / "jupyter" / "jupyter.log"
    if log.exists():  # the server's log stays with the screenshots, for when something failed
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(log, SCREENSHOTS / "jupyter.log")
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def project(scratch, embedded_dir):
    """The course copied to a scratch folder: its runs/, carried config and saved notebooks stay there."""
    return copy_project(scratch / "project")


@pytest.fixture(scope="session")
def lab(project, scratch):
    server = LabServer(project, scratch / "jupyter")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def page(scratch):
    from playwright.sync_api import expect, sync_playwright

    # What the page shows after a move waits on the kernel, and on CI's 2 cores the other test worker trains beside
    # it: expect() polls for 30 s instead of 5, a hang detector rather than a speed check
    expect.set_options(timeout=30_000)

    profile = scratch / "chromium-profile"  # a fresh --user-data-dir
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(str(profile), executable_path=chromium_path(),
                                                       args=CHROMIUM_FLAGS, viewport={"width": 1400, "height": 1000})
        context.set_default_timeout(60_000)
        yield context.pages[0] if context.pages else context.new_page()
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="session")
def screenshots():
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS


@pytest.fixture(autouse=True)
def one_failure_stays_one(request):
    """A test that fails half-way leaves its notebook open with unsaved changes, and the next test's close() would
    wait on the "save your work?" dialog: close it unsaved, so the next test starts from what is on disk."""
    yield
    if "page" in request.fixturenames:
        discard_open_notebooks(request.getfixturevalue("page"))
