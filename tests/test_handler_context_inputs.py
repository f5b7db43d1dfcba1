"""Context fields as an infer's inputs through the real daemon: a profile kept in a context
scores as sending it does, an append keeps a sliding window of events one context version per
request and answers on the window, the window survives a killed scheduler, and another tenant
can neither read nor append to it. The scheduler's side in-process: tests/test_context_inputs.py."""
from pathlib import Path

import numpy as np
import pytest

from mcpd.client import Client
from mcpd.handlers.examples.risk_scorer import FEATURES
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.testing import Daemon
from conftest import DAEMON_ENVIRONMENT
from test_storage_daemon import kill_scheduler

REPO = Path(__file__).resolve().parent.parent
WINDOW = 4
APPEND = {"recent": {"input": "events", "window": WINDOW}}


@pytest.fixture(scope="module")
def daemon():
    d = Daemon(environment={**DAEMON_ENVIRONMENT, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}, **{
        "pool": {"shared": False},
        "models.risk": {}, "models.risk.versions.v1": {"handler": "mcpd.handlers.examples.risk_scorer:RiskRules"},
        "models.window": {}, "models.window.versions.v1": {"handler": "window_handlers:WindowSum"},
    })
    d.start()
    yield d
    d.stop()
    d.cleanup()


def events(start: int, count: int) -> np.ndarray:
    """Events start..start+count-1, each [n, -n]: a window's sum says which it holds."""
    n = np.arange(start, start + count, dtype=np.float32)
    return np.stack([n, -n], axis=1)


def append(client: Client, context_id: str, rows: np.ndarray):
    return client.infer("window", {"events": rows}, context=context_id, context_append=APPEND)


def test_a_profile_kept_in_a_context_scores_as_sending_it(daemon):
    profile = np.random.default_rng(1).normal(size=FEATURES).astype(np.float32)
    with Client(daemon.endpoint, tenant="bank") as client:
        user = client.context("user-1")
        user["profile"] = profile
        user.sync()
        read = client.infer("risk", {}, context="user-1", context_inputs={"features": "profile"})
        sent = client.infer("risk", {"features": profile[np.newaxis]})
    assert read.outputs["score"].shape == (1,)
    np.testing.assert_array_equal(read.outputs["score"], sent.outputs["score"])
    assert (read.context_version, sent.context_version) == (user.version, None)


def test_appends_keep_a_sliding_window_one_version_each_and_answer_on_it(daemon):
    with Client(daemon.endpoint, tenant="shop") as client:
        start = client.context("stream").version
        for step in range(5):   # two events a request: from the third on, the oldest fall out
            result = append(client, "stream", events(2 * step, 2))
            window = events(max(0, 2 * step + 2 - WINDOW), min(WINDOW, 2 * step + 2))
            assert result.context_version == start + step + 1
            np.testing.assert_array_equal(result.outputs["total"], window.sum(axis=0)[np.newaxis])
            assert result.outputs["count"].tolist() == [len(window)]
        kept = client.context("stream", create=False)
        assert kept.version == start + 5
        np.testing.assert_array_equal(kept["recent"], events(10 - WINDOW, WINDOW))


def test_another_tenant_can_neither_read_nor_append_to_the_context(daemon):
    with Client(daemon.endpoint, tenant="alice") as alice, Client(daemon.endpoint, tenant="mallory") as mallory:
        own = alice.context("private")
        own["profile"] = np.ones(FEATURES, np.float32)
        own.sync()
        attempts = (lambda: mallory.infer("risk", {}, context="private", context_inputs={"features": "profile"}),
                    lambda: append(mallory, "private", events(0, 1)))
        for attempt in attempts:
            with pytest.raises(MCPDError) as refused:
                attempt()
            assert refused.value.code == codes.NOT_FOUND and "private" in refused.value.message
        again = alice.context("private", create=False)
        assert again.version == own.version and set(again.keys()) == {"profile"}
        assert mallory.call("context.list", {})["contexts"] == []


def test_the_window_survives_a_killed_scheduler_and_grows_on(daemon):
    with Client(daemon.endpoint, tenant="keeper") as client:
        client.call("context.open", {"id": "kept"})
        for step in range(3):
            version = append(client, "kept", events(step, 1)).context_version
    kill_scheduler(daemon)
    with Client(daemon.endpoint, tenant="keeper", timeout=120) as client:
        restored = client.context("kept", create=False)
        assert restored.version == version
        np.testing.assert_array_equal(restored["recent"], events(0, 3))
        result = append(client, "kept", events(3, 2))
        assert result.context_version == version + 1
        np.testing.assert_array_equal(result.outputs["total"], events(1, WINDOW).sum(axis=0)[np.newaxis])

