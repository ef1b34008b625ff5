"""A real JupyterLab in a real browser, for the browser suite: the server (a free localhost port, a token, its own
settings and kernels), Chromium through Playwright, and the few things a person does: open a notebook, run a
cell, move a control, read what is shown."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from nb_helpers.config import PROJECT_ROOT
from nb_helpers.distributed import free_port

CHROMIUM_ENV = "NB_CHROMIUM"  # another Chromium or Chrome binary than Debian's
DEFAULT_CHROMIUM = "/usr/bin/chromium"
REQUIRED_ENV = "NB_BROWSER_REQUIRED"  # CI sets it: a missing browser fails the suite instead of skipping it
# Flags that work in containers and offline machines: no sandbox (root), no GPU, no network chatter
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Test-only JupyterLab settings: every cell stays in the page (no virtual scrolling), no news or update pop-ups.
TEST_SETTINGS = {
    "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
}
COURSE_SETTINGS = PROJECT_ROOT / "jupyter" / "qlora-course.json"  # what `make setup` installs for `make lab`


def chromium_path() -> str:
    return os.environ.get(CHROMIUM_ENV, DEFAULT_CHROMIUM)


def missing_requirement() -> str | None:
    """Why the suite cannot run here, in one line with the fix; None when it can."""
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "browser suite skipped: Playwright is not installed (pip install -r requirements-test.txt)"
    if not Path(chromium_path()).exists():
        return (f"browser suite skipped: no Chromium at {chromium_path()} (install it: sudo apt-get install chromium, "
                f"or set {CHROMIUM_ENV}=/path/to/chromium); then `make test-browser`")
    return None


def copy_project(dest: Path) -> Path:
    """The course in a scratch folder, so runs/, the carried config and saved notebooks never touch the real one."""
    # bench/results: the GPU benchmark notebook 04 shows (notebook 02's model shapes are package data of nb_helpers)
    for name in ("nb_helpers", "notebooks", "data", "jupyter", "bench/results"):
        shutil.copytree(PROJECT_ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", ".ipynb_*"))
    shutil.copy(PROJECT_ROOT / "pyproject.toml", dest / "pyproject.toml")
    cache = PROJECT_ROOT / ".cache"
    if cache.exists():  # the embedded model, fetched once per checkout
        (dest / ".cache").symlink_to(cache.resolve(), target_is_directory=True)
    return dest


class LabServer:
    """`jupyter lab` on a free localhost port with a token, in CI mode, isolated from the user's Jupyter setup."""

    def __init__(self, project: Path, scratch: Path):
        self.project, self.port, self.token = project, free_port(), secrets.token_hex(16)
        dirs = {name: scratch / name for name in ("config", "data", "runtime", "ipython", "user-settings",
                                                  "workspaces", "app-settings")}
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        overrides = dirs["app-settings"] / "overrides.d"
        overrides.mkdir()
        shutil.copy(COURSE_SETTINGS, overrides / COURSE_SETTINGS.name)  # the settings users get from `make lab`
        (overrides / "zz-tests.json").write_text(json.dumps(TEST_SETTINGS))
        env = {**os.environ, "NB_CI": "1", "PYTHONPATH": str(project), "HF_HUB_OFFLINE": "1",
               "JUPYTER_CONFIG_DIR": str(dirs["config"]), "JUPYTER_DATA_DIR": str(dirs["data"]),
               "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]), "IPYTHONDIR": str(dirs["ipython"]),
               "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
        env.pop("NB_CONFIG", None)
        self.log_path = scratch / "jupyter.log"
        args = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
                f"--ServerApp.token={self.token}", f"--ServerApp.root_dir={project / 'notebooks'}",
                "--ServerApp.port_retries=0", "--LabApp.expose_app_in_browser=True",
                f"--LabApp.user_settings_dir={dirs['user-settings']}",
                f"--LabApp.workspaces_dir={dirs['workspaces']}", f"--LabApp.app_settings_dir={dirs['app-settings']}"]
        if hasattr(os, "getuid") and os.getuid() == 0:
            args.append("--allow-root")
        self.process = subprocess.Popen(args, env=env, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT,
                                        cwd=project)
        self.wait_ready()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, path: str, method: str = "GET"):
        request = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.process.returncode}:\n{self.log_path.read_text()}")
            try:
                self.api("status")
                return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(f"jupyter lab did not answer within {timeout} s:\n{self.log_path.read_text()}")

    def shutdown_kernels(self) -> None:
        for kernel in self.api("kernels"):
            self.api(f"kernels/{kernel['id']}", method="DELETE")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()


# --- the notebook, as a person sees it --------------------------------------------------------------------------
# JupyterLab exposes itself as window.jupyterapp (expose_app_in_browser): running cells goes through its commands,
# as the Run menu does, while everything asserted is read from the rendered page.
# What JupyterLab and ipywidgets show instead of a widget they cannot render
WIDGET_FAILURES = ("Error displaying widget", "Error rendering", "Failed to create view", "Could not create a view",
                   "Loading widget...")
# The notebook panel by its path (the launcher or another tab may be the current widget)
PANEL = "Array.from(window.jupyterapp.shell.widgets('main')).find(w => w.context && w.context.path === name)"
JS_RUN = """async ([name, index]) => {
  const app = window.jupyterapp, panel = %s, nb = panel.content;
  app.shell.activateById(panel.id); nb.deselectAll(); nb.activeCellIndex = index;
  app.commands.execute('notebook:run-cell');  // not awaited: the test watches the page while it runs
}""" % PANEL
JS_STATE = """([name, index]) => {
  const panel = %s, cell = panel.content.widgets[index];
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  return {count: cell.model.executionCount, prompt: cell.node.querySelector('.jp-InputPrompt').textContent,
          kernel: kernel ? kernel.status : null, type: cell.model.type,
          outputs: cell.model.outputs ? cell.model.outputs.toJSON() : []};
}""" % PANEL
JS_READY = """(name) => { if (!window.jupyterapp) return false; const panel = %s; if (!panel || !panel.content.widgets.length) return false;
  const s = panel.sessionContext; return !!(s.session && s.session.kernel && s.session.kernel.status === 'idle'); }
""" % PANEL
JS_SOURCES = """(name) => (%s).content.widgets.map(
  c => c.model.type === 'code' ? c.model.sharedModel.getSource() : '')""" % PANEL  # code cells only
JS_ALL_OUTPUTS = "(name) => (%s).content.widgets.map(c => c.model.outputs ? c.model.outputs.toJSON() : [])" % PANEL
JS_ASK = """async ([name, code]) => {  // like the console: runs in the notebook's kernel, adds no cell
  const kernel = (%s).sessionContext.session.kernel, out = [];
  const future = kernel.requestExecute({code, silent: false, store_history: false});
  future.onIOPub = msg => {
    const c = msg.content, t = msg.header.msg_type;
    if (t === 'stream') out.push(c.text);
    if (t === 'error') out.push(`${c.ename}: ${c.evalue}`);
    if (t === 'execute_result') out.push(c.data['text/plain']);
  };
  await future.done;
  return out.join('');
}""" % PANEL
JS_EDIT = """([name, index, source]) => {  // as typing into the cell would: its outputs stay until it runs again
  const cell = (%s).content.widgets[index]; cell.model.sharedModel.setSource(source);
}""" % PANEL
JS_CLEAR = """([name, index]) => { (%s).content.widgets[index].model.outputs.clear(); }""" % PANEL
JS_SAVE = """async (name) => { const panel = %s; await panel.context.save(); return panel.context.model.dirty; }
""" % PANEL


def discard_open_notebooks(page) -> None:
    """Close every open notebook without saving and without JupyterLab's "save your work?" dialog."""
    if page.url.startswith("http") and page.evaluate("() => !!window.jupyterapp"):
        page.evaluate("() => { for (const w of Array.from(window.jupyterapp.shell.widgets('main'))) "
                      "{ if (w.context) { w.context.model.dirty = false; w.dispose(); } } }")


class Notebook:
    def __init__(self, page, lab: LabServer, name: str):
        self.page, self.lab, self.name = page, lab, name

    def open(self) -> "Notebook":
        """Open it as the file browser does (the first time, load JupyterLab at its URL)."""
        if self.page.url.startswith(self.lab.url) and self.page.evaluate("() => !!window.jupyterapp"):
            self.page.evaluate("async (path) => { await window.jupyterapp.commands.execute('docmanager:open', "
                               "{path}); }", self.name)  # returns nothing: the widget itself cannot be serialized
        else:
            self.page.goto(f"{self.lab.url}/lab/tree/{self.name}?token={self.lab.token}")
        self.page.wait_for_function(JS_READY, arg=self.name, timeout=120_000)  # rendered, and its kernel is up
        return self

    def sources(self) -> list[str]:
        """The source of every cell ('' for markdown), in order."""
        return self.page.evaluate(JS_SOURCES, self.name)

    def index_of(self, text: str) -> int:
        """The code cell whose source contains `text`: found by content, so inserted cells do not break a test."""
        hits = [i for i, s in enumerate(self.sources()) if text in s]
        assert len(hits) == 1, f"{self.name}: expected one cell containing {text!r}, found {hits}"
        return hits[0]

    def cell(self, index: int):
        return self.panel().locator(".jp-Cell").nth(index)

    def panel(self):
        return self.page.locator(".jp-NotebookPanel:visible").first

    def state(self, index: int) -> dict:
        return self.page.evaluate(JS_STATE, [self.name, index])

    def run(self, index: int, timeout: float = 900, watch=None) -> dict:
        """Run one cell and wait until it finished; `watch(state)` is called while it runs."""
        before = self.state(index)["count"]
        self.page.evaluate(JS_RUN, [self.name, index])
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.state(index)
            done = state["count"] is not None and state["count"] != before and "*" not in state["prompt"]
            if done and state["kernel"] == "idle":
                return state
            if watch:
                watch(state)
            time.sleep(0.25)
        raise TimeoutError(f"{self.name} cell {index} still running after {timeout} s")

    def run_all_from(self, start: int, stop: int | None = None, timeout: float = 900) -> None:
        sources = self.sources()
        for index in range(start, len(sources) if stop is None else stop):
            if self.state(index)["type"] == "code":
                self.run(index, timeout)

    def errors(self, settle: float = 20) -> list[str]:
        """Every error output, and every widget that could not be shown, in the whole notebook (a widget still
        "Loading widget..." gets `settle` seconds to finish)."""
        deadline = time.time() + settle
        while True:
            found = []
            for index, outputs in enumerate(self.page.evaluate(JS_ALL_OUTPUTS, self.name)):
                for out in outputs:
                    if out.get("output_type") == "error":
                        found.append(f"cell {index}: {out.get('ename')}: {out.get('evalue')}")
            for text in self.panel().locator(".jp-OutputArea-output").all_inner_texts():
                if any(sign in text for sign in WIDGET_FAILURES):
                    found.append(f"output shows {text.strip()[:200]!r}")
            if not found or time.time() > deadline or not all("Loading widget" in f for f in found):
                return found
            time.sleep(0.5)

    def ask(self, code: str) -> str:
        """What `code` prints in the notebook's kernel, as typed into a console attached to it (no cell added)."""
        return self.page.evaluate(JS_ASK, [self.name, code])

    def edit(self, index: int, source: str) -> None:
        """Replace a cell's source, as a person editing it would."""
        self.page.evaluate(JS_EDIT, [self.name, index, source])

    def clear_outputs(self, index: int) -> None:
        self.page.evaluate(JS_CLEAR, [self.name, index])

    def save(self) -> None:
        assert self.page.evaluate(JS_SAVE, self.name) is False, f"{self.name} still has unsaved changes"

    def close(self) -> None:
        self.page.evaluate("() => window.jupyterapp.commands.execute('application:close-all')")
        self.page.wait_for_function(  # JupyterLab may show its launcher instead: no notebook is left open
            "() => !Array.from(window.jupyterapp.shell.widgets('main')).some(w => w.context)", timeout=30_000)

    def screenshot(self, index: int, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.cell(index).scroll_into_view_if_needed()
        self.page.screenshot(path=str(path))
