# Two commands do everything on a fresh machine: `make run` and `make test`. `make lab` opens the course.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

TEST_STAMP := $(VENV)/.test-installed-stamp
# matplotlib's font cache lives in the venv: the shared one in ~/.cache can name fonts of a venv since deleted
# (seen in CI: "findfont: Font family ['STIXGeneral'] not found" on every log-scale axis)
export MPLCONFIGDIR := $(abspath $(VENV))/matplotlib
# JupyterLab reads every file in overrides.d: ours saves widget state with the notebook, so a reopened notebook
# shows its sliders and panels instead of "Error displaying widget: model not found"
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings/overrides.d/qlora-course.json

.PHONY: setup run executed test test-gpu test-unit test-notebooks test-browser lab env clean-notebooks results

# llama-cpp-python is built from source once (then pip reuses the wheel): on x86-64 for any AVX2 CPU rather than for
# this one. The build llama.cpp tunes to the build machine (GGML_NATIVE) crashed with a general protection fault in
# libggml-cpu on our AVX-512 Xeon as soon as notebook 05 ran a GGUF; the AVX2 build runs there and on most laptops.
LLAMA_CMAKE_ARGS ?= $(if $(filter x86_64,$(shell uname -m)),-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON,)

# With an NVIDIA GPU (nvidia-smi answers), the GPU extras too: liger-kernel's fused kernels for the fast path.
$(STAMP): requirements.txt requirements-stack.txt requirements-gpu.txt pyproject.toml jupyter/qlora-course.json
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install -q --disable-pip-version-check -r $(if $(shell nvidia-smi -L 2>/dev/null),requirements-gpu.txt,requirements.txt)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	@mkdir -p $(dir $(LAB_SETTINGS)) && cp jupyter/qlora-course.json $(LAB_SETTINGS)
	@touch $(STAMP)

# Playwright for the browser suite; it drives the system's Chromium and never downloads a browser
$(TEST_STAMP): requirements-test.txt $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-test.txt
	@touch $(TEST_STAMP)

setup: $(STAMP)

## make run: the whole course (notebooks 00-07) on the embedded default; executed copies land in runs/latest/notebooks
run: setup
	$(PY) -m nb_helpers course

## make executed: the same run, its executed notebooks (outputs, plots, tables) also saved to docs/executed/, which
## the README links: what to expect before running anything. Commit them after a fresh run on a CPU.
executed: setup
	$(PY) -m nb_helpers course --executed-dir docs/executed

## make test: unit tests and the browser suite, then every notebook top to bottom in CI mode (NB_CI=1 shrinks them)
test: test-unit test-notebooks

# tests/ includes tests/browser; without Chromium it is skipped with one line saying how to enable it.
# Two worker processes (pytest-xdist), a whole test file each at a time: the browser flow's tests stay one flow in one
# process. On CI's 2 cores, as AVX2, the unit suite took 695 and 724 s in one process, 588 s in two (659 s with the
# browser flow forced first, --no-loadscope-reorder; the files with the most tests go first by default).
# OMP_WAIT_POLICY=PASSIVE: torch's OpenMP threads otherwise spin while they wait and take the cores from the other
# worker (an 8-step training took 227 s instead of 47 s).
TEST_WORKERS ?= 2
test-unit: $(TEST_STAMP)
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile tests

## make test-browser: only the browser suite (JupyterLab in Chromium: notebooks 02-04 as a person uses them)
test-browser: $(TEST_STAMP)
	$(PY) -m pytest tests/browser -v

## make test-gpu: on a machine with an NVIDIA GPU (make setup installs the GPU pins there), the whole unit suite with
## the GPU tests beside the CPU ones; the log (GPU, driver, versions, every result) lands in runs/gpu-tests/
test-gpu: $(TEST_STAMP)
	@nvidia-smi -L >/dev/null 2>&1 || { echo "make test-gpu needs an NVIDIA GPU (nvidia-smi finds none)"; exit 2; }
	PY=$(PY) OUT=runs/gpu-tests bash bench/gpu_checks.sh

# On a scratch copy whose outputs nbmake keeps (--overwrite), so tests/notebook_outputs.py can refuse stderr in any cell
EXECUTED := runs/ci/executed
test-notebooks: setup
	rm -rf $(EXECUTED) && mkdir -p $(EXECUTED) && cp notebooks/*.ipynb $(EXECUTED)/
	NB_CI=1 $(PY) -m pytest --nbmake --nbmake-timeout=1800 --overwrite -p no:cacheprovider $(EXECUTED)
	$(PY) tests/notebook_outputs.py $(EXECUTED)

# Containers and WSL often run as root, which JupyterLab refuses without --allow-root.
lab: setup
	$(PY) -m jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root,) $(LAB_ARGS)

env: setup
	$(PY) -m nb_helpers env

## make results: bench/results/latest.json and bench/RESULTS.md again, from the run files in bench/results/runs/
## (the standard library only: no setup needed)
results:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) bench/summarize.py

## strip outputs and execution counts before committing a notebook
clean-notebooks: setup
	$(PY) -m nb_helpers clean-notebooks
