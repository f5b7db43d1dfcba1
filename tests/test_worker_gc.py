"""A worker keeps what it loaded before serving (torch, the model and their libraries: hundreds of
thousands of objects) out of the garbage collector's reach, so that a full collection while it
serves walks only what serving made, rather than stalling every request in flight for tens or
hundreds of ms. Seen through the real daemon: a handler that reports its process's frozen count.
The front-end and the scheduler do the same with what their start-up made, and report the count
in `status`."""
from pathlib import Path

import numpy as np
import pytest

from mcpd.testing import Daemon
from conftest import DAEMON_ENVIRONMENT

REPO = Path(__file__).resolve().parent.parent
# Far fewer than torch alone brings (over 100k): a worker that froze nothing reports 0
LOADED_OBJECTS = 10_000
# Fewer than the front-end's or the scheduler's imports alone bring: one that froze nothing reports 0
STARTUP_OBJECTS = 10_000


@pytest.fixture(scope="module")
def daemon():
    d = Daemon(environment={**DAEMON_ENVIRONMENT, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}, **{
        "pool": {"shared": False},
        "models.frozen": {}, "models.frozen.versions.v1": {"handler": "frozen_count_handler:FrozenCount"},
    })
    d.start()
    yield d
    d.stop()


def test_a_handler_worker_serves_with_what_it_loaded_frozen(daemon):
    result = daemon.client().infer("frozen", {"features": np.zeros((2, 256), np.float32)})
    assert result.outputs["score"].shape == (2,)
    assert result.outputs["score"].min() >= LOADED_OBJECTS


def test_the_frontend_and_the_scheduler_serve_with_what_start_up_made_frozen(daemon):
    processes = {p["role"]: p for p in daemon.status()["processes"]}
    for role in ("frontend", "scheduler"):
        assert processes[role]["frozen_objects"] >= STARTUP_OBJECTS, processes[role]
