"""A handler worker's threads on the cores it owns, in the daemon as shipped (OpenMP's binding on,
unlike the other daemon tests, conftest.DAEMON_ENVIRONMENT): with fewer torch threads than cores,
neither its loop nor its predict thread is held to the one core OpenMP bound at torch's import,
so a predict runs on whichever core is free; and while requests stream in, the loop decodes,
tokenizes and answers on whichever core is free too."""
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from mcpd.testing import Daemon

SCORER = "mcpd.handlers.examples.risk_scorer:RiskScorer"
# Loading it (torch through transformers) leaves the worker's main thread bound by OpenMP to one
# core, as the risk scorer's set-up does not: the loop's own placement is then what keeps it free.
CLASSIFIER = "mcpd.handlers.examples.text_classifier:TextClassifier"
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


def test_a_text_classifier_workers_loop_runs_on_every_core_while_it_serves():
    """After a lull (the loop frees its thread once idle), a stream of requests: the worker's main
    thread (its id is the pid), which runs no parallel region while it serves, must not go back
    to the core OpenMP bound it to."""
    daemon = Daemon(**{"pool": {"shared": False}, "workers": {"device": "cpu", "threads": 1},
                       "models.text": {}, "models.text.versions.v1": {"handler": CLASSIFIER}})
    try:
        daemon.start()
        seen = _main_thread_cores_while_serving(daemon)
    finally:
        daemon.stop()
        daemon.cleanup()
    assert seen and all(cores == CORES for cores in seen), [cores for cores in seen if cores != CORES][:3]


def _main_thread_cores_while_serving(daemon: Daemon, clients: int = 8, each: int = 40) -> list[list[int]]:
    """The worker's main thread's cores, read every 10 ms while `clients` clients send `each` requests."""
    worker = daemon.pid_of("worker")
    text = np.array([b"card payment refund account transfer"], dtype=object)
    daemon.client().infer("text", {"text": text})
    time.sleep(0.5)   # a lull: the loop has freed its thread

    def client(_) -> None:
        with daemon.client() as one:
            for _ in range(each):
                one.infer("text", {"text": text})
    seen = []
    with ThreadPoolExecutor(clients) as pool:
        sending = [pool.submit(client, i) for i in range(clients)]
        while not all(f.done() for f in sending):
            seen.append(sorted(os.sched_getaffinity(worker)))
            time.sleep(0.01)
        for f in sending:
            f.result()
    return seen
