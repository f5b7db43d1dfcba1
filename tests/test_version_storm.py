"""A storm of version switches under closed-loop load, on a real daemon: every request gets its
final reply, also those that wait for a version while it is unloaded, whose worker is stopped
only once their finals are on their way to the front-end.

The daemon serves model m: a (primary), c (loaded), and b configured unloaded. Eight clients
send greedy generates, each with a routing key of its own, so a split spreads each client's
requests over the versions."""
import os
import signal
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress

import pytest

from mcpd.testing import SteadyLoad

pytestmark = pytest.mark.slow
CLIENTS = 8
CLIENT_TIMEOUT_S = 30   # a lost final shows as a client's TIMEOUT after this
GREEDY = {"max_tokens": 2, "temperature": 0}
MODEL = {"model": "m"}
# Between b taking traffic and b's unload: switches that move traffic about while b's requests wait.
STORM = [("models.unload", {**MODEL, "version": "c"}),
         ("models.split", {**MODEL, "weights": {"a": 2, "b": 1}}),
         ("models.split", {**MODEL, "weights": {"a": 1, "b": 2}}),
         ("models.rollback", MODEL),
         ("models.load", {**MODEL, "version": "c"}),
         ("models.promote", {**MODEL, "version": "c"}),
         ("models.promote", {**MODEL, "version": "a"})]


@pytest.fixture
def storm(fresh_daemon):
    return fresh_daemon(**{"models.m": {"default": "a"}, "models.m.versions.a": {},
                           "models.m.versions.b": {"loaded": False}, "models.m.versions.c": {}})


def version_b(daemon) -> dict:
    """b's figures as the scheduler last reported them (status() would wait for a frozen front-end)."""
    return daemon.control("status")["models"]["models"]["m"]["versions"]["b"]


def idle(version: dict) -> bool:
    return version["routed"] == CLIENTS and version["queued"] == version["running"] == 0


def test_unloading_a_version_while_requests_wait_for_it_loses_no_final(storm):
    """Every client ends up waiting for b while b's worker starts; b is unloaded while they wait.
    The worker then answers them all at once and the version's last Done reaches the scheduler,
    but its finals cannot have reached the front-end: the worker first met the front-end while
    the front-end was frozen (SIGSTOP), so their connection is not open yet. Stopping the worker
    then lost them all. Every request must be answered well: none names a version, so none can
    be refused (no error code is expected)."""
    with SteadyLoad(storm, CLIENTS, CLIENT_TIMEOUT_S, key_each=True, **GREEDY) as load, \
            ThreadPoolExecutor(1) as background:
        load.wait_for(CLIENTS)
        worker = storm.control("models.load", {**MODEL, "version": "b"})["workers"][0]
        worker_pid, frontend_pid = storm.pid_of("worker", worker), storm.pid_of("frontend")
        os.kill(worker_pid, signal.SIGSTOP)   # still loading its model: not connected to the front-end yet
        try:
            storm.control("models.split", {**MODEL, "weights": {"a": 1, "b": 1}})
            storm.wait_until(lambda: version_b(storm)["routed"] == CLIENTS, what="every client waiting for b")
            for op, args in STORM:
                storm.control(op, args)
            os.kill(frontend_pid, signal.SIGSTOP)
            unload = background.submit(storm.control, "models.unload", {**MODEL, "version": "b"}, 60)
            storm.wait_until(lambda: not version_b(storm)["loaded"], what="b unloading")
            os.kill(worker_pid, signal.SIGCONT)
            # The scheduler reports b idle only after it has answered the unload, if it does so
            # on the Done notes alone: the supervisor has stopped the worker by then.
            storm.wait_until(lambda: idle(version_b(storm)), what="b's requests done")
        finally:
            for pid in (frontend_pid, worker_pid):
                with suppress(ProcessLookupError):   # b's worker is gone once b is unloaded
                    os.kill(pid, signal.SIGCONT)
        assert unload.result()["loaded"] is False
        load.wait_for(CLIENTS)   # a answers again
    routed = {v: f["routed"] for v, f in storm.status()["models"]["models"]["m"]["versions"].items()}
    answered = Counter(load.versions)
    assert load.failed == []
    assert routed == {"a": answered["a"], "b": answered["b"], "c": 0} and answered["b"] == CLIENTS
