"""A handler worker's threads on the cores it owns, in the daemon as shipped (OpenMP's binding on,
unlike the other daemon tests, conftest.DAEMON_ENVIRONMENT): with fewer torch threads than cores,
neither its loop nor its predict thread is held to the one core OpenMP bound at torch's import,
so a predict runs on whichever core is free."""
import os
from pathlib import Path

import numpy as np
import pytest

from mcpd.testing import Daemon

SCORER = "mcpd.handlers.examples.risk_scorer:RiskScorer"
CORES = sorted(os.sched_getaffinity(0))   # the daemon's processes inherit them

pytestmark = pytest.mark.skipif(len(CORES) < 2, reason="one core: nothing to be held off")


def allowed_cores(pid: int) -> dict[int, list[int]]:
    """Each thread of `pid` -> the cores it may run on."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found[int(task.name)] = sorted(os.sched_getaffinity(int(task.name)))
        except ProcessLookupError:   # a thread that ended meanwhile
            pass
    return found


@pytest.fixture(scope="module")
def daemon():
    d = Daemon(**{"pool": {"shared": False}, "workers": {"device": "cpu", "threads": 1},
                  "models.risk": {}, "models.risk.versions.v1": {"handler": SCORER}})
    d.start()
    yield d
    d.stop()
    d.cleanup()


def test_a_one_thread_handler_worker_runs_on_every_core_it_owns(daemon):
    features = np.random.default_rng(0).normal(size=(2, 256)).astype(np.float32)
    assert daemon.client().infer("risk", {"features": features}).outputs["score"].shape == (2,)   # the predict thread exists
    index = daemon.client().status()["models"]["models"]["risk"]["versions"]["v1"]["workers"][0]
    threads = allowed_cores(daemon.pid_of("worker", index))
    assert len(threads) >= 2 and threads == {tid: CORES for tid in threads}
