# Two commands do everything on a fresh machine: `make run` and `make test`. `make lab` opens the course.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup run test test-unit test-notebooks lab env clean-notebooks

# With an NVIDIA GPU (nvidia-smi answers), the GPU extras too: liger-kernel's fused kernels for the fast path.
$(STAMP): requirements.txt requirements-gpu.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r $(if $(shell nvidia-smi -L 2>/dev/null),requirements-gpu.txt,requirements.txt)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	@touch $(STAMP)

setup: $(STAMP)

## make run: the whole course (notebooks 00-05) on the embedded default; executed copies land in runs/latest/notebooks
run: setup
	$(PY) -m nb_helpers course

## make test: unit tests, then every notebook top to bottom in CI mode (NB_CI=1 shrinks them)
test: test-unit test-notebooks

test-unit: setup
	$(PY) -m pytest tests

test-notebooks: setup
	NB_CI=1 $(PY) -m pytest --nbmake --nbmake-timeout=1800 notebooks

# Containers and WSL often run as root, which JupyterLab refuses without --allow-root.
lab: setup
	$(PY) -m jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root,) $(LAB_ARGS)

env: setup
	$(PY) -m nb_helpers env

## strip outputs and execution counts before committing a notebook
clean-notebooks: setup
	$(PY) -m nb_helpers clean-notebooks
