# `make run`: set up and run the daemon in the foreground on the embedded model.
# `make test`: set up and run the test suite (what .ci/run calls).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= etc/mcpd.toml
# On a machine without an NVIDIA GPU take the CPU build of torch that ships on local disk
# (seconds); with a GPU let pip take its default, a CUDA build.
TORCH := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: run test setup setup-test bench clean
run: $(VENV)/.runtime
	$(VENV)/bin/mcpd --config $(CONFIG)

test: $(VENV)/.test
	$(PY) -m pytest -q

bench: $(VENV)/.test
	for b in bench/*.py; do $(PY) $$b --quick || exit 1; done

setup: $(VENV)/.runtime
setup-test: $(VENV)/.test

$(VENV)/.runtime: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	$(PY) -m pip install -q -e '.[test]'
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
