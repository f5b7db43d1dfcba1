"""A storm of version switches under closed-loop load, on a real daemon (mcpd.testing's
version_storm): every request gets its final reply, also those that wait for a version while it
is unloaded, whose worker is stopped only once their replies reached the front-end."""
from collections import Counter

import pytest

from mcpd.testing import STORM_CONFIG, SteadyLoad, version_storm

pytestmark = pytest.mark.slow
CLIENTS = 8
CLIENT_TIMEOUT_S = 30   # a lost final shows as a client's TIMEOUT after this


def test_unloading_a_version_while_requests_wait_for_it_loses_no_final(fresh_daemon):
    """Every client ends up waiting for b while b's worker starts, and b is unloaded while they
    wait; the worker first meets the front-end while the front-end is frozen, so its replies are
    still in it when its last Done reaches the scheduler: stopping it then lost them all. Each
    client sends its requests with routing keys of their own and names no version, so none can be
    refused: every one must be answered well (no error code is expected)."""
    daemon = fresh_daemon(**STORM_CONFIG)
    with SteadyLoad(daemon, CLIENTS, CLIENT_TIMEOUT_S, key_each=True, max_tokens=2, temperature=0) as load:
        load.wait_for(CLIENTS)
        assert version_storm(daemon, load)["loaded"] is False
        load.wait_for(CLIENTS)   # a answers again
    routed = {v: f["routed"] for v, f in daemon.status()["models"]["models"]["m"]["versions"].items()}
    answered = Counter(load.versions)
    assert load.failed == []
    assert routed == {"a": answered["a"], "b": answered["b"], "c": 0} and answered["b"] == CLIENTS
