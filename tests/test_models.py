"""Several versions of one model served at once by a real daemon: routing by name, refusals,
promote and rollback under load with no request lost, unload and load of a version's workers.
Two versions of a tiny test checkpoint (different seeds: different weights, so their greedy
tokens tell them apart) and a third, configured unloaded."""
import tempfile
import time
from pathlib import Path

import pytest

from mcpd.daemon.scheduler.batching_window import ADJUST_EVERY
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.testing import SteadyLoad, free_port
from test_http import raw
from test_metrics import scrape
from tiny_checkpoints import make_checkpoint

pytestmark = pytest.mark.slow
GREEDY = {"max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def checkpoints():
    root = Path(tempfile.mkdtemp(prefix="mcpd-models-"))
    return make_checkpoint(root / "a", "llama", seed=1), make_checkpoint(root / "b", "llama", seed=2)


@pytest.fixture(scope="module")
def served(module_daemon, checkpoints):
    a, b = checkpoints
    daemon = module_daemon(**{"models.tiny": {"default": "a"}, "models.tiny.versions.a": {"path": str(a)},
                              "models.tiny.versions.b": {"path": str(b)},
                              "models.tiny.versions.c": {"path": str(a), "loaded": False},
                              "http": {"listen": f"127.0.0.1:{free_port()}"}})
    daemon.base_url = f"http://{daemon.control('config')['config']['http']['listen']}/v1"
    return daemon


def test_two_versions_serve_at_once_each_on_its_own_workers(served):
    with served.client() as client:
        first = client.generate("hello", **GREEDY)
        other = client.generate("hello", version="b", **GREEDY)
        named = client.generate("hello", model="tiny", version="a", **GREEDY)
    assert (first.model, first.version, other.version, named.version) == ("tiny", "a", "b", "a")
    assert first.token_ids == named.token_ids != other.token_ids
    versions = served.status()["models"]["models"]["tiny"]["versions"]
    assert [p["state"] for p in versions["c"]["processes"]] == ["unloaded"]
    assert versions["a"]["workers"] and versions["b"]["workers"] and not set(versions["a"]["workers"]) & set(versions["b"]["workers"])


@pytest.mark.parametrize("names, says", [({"model": "nope"}, "no model 'nope'"),
                                         ({"version": "zz"}, "no version 'zz'"),
                                         ({"version": "c"}, "is not loaded")])
def test_a_model_or_version_not_served_is_refused_with_unknown_model(served, names, says):
    with served.client() as client, pytest.raises(MCPDError) as refused:
        client.generate("hello", **names, **GREEDY)
    assert refused.value.code == codes.UNKNOWN_MODEL and says in refused.value.message


def test_promote_and_rollback_under_load_lose_no_request(served):
    with SteadyLoad(served) as load:
        load.wait_for(8)
        assert served.control("models.promote", {"model": "tiny", "version": "b"})["primary"] == "b"
        with served.client() as client:
            assert client.generate("x", **GREEDY).version == "b"   # admitted after the op: the new primary
        load.wait_for(8)
        assert served.control("models.rollback", {"model": "tiny"})["primary"] == "a"
        with served.client() as client:
            assert client.generate("x", **GREEDY).version == "a"
        load.wait_for(8)
    assert load.failed == [] and {"a", "b"} <= set(load.versions)


def test_split_sends_each_routing_key_to_one_version(served):
    done = served.mcpctl("models", "split", "tiny", "a=1", "b=1")
    assert done.returncode == 0, done.stderr
    try:
        with served.client() as client:
            first = {key: client.generate("x", routing_key=key, **GREEDY).version for key in map(str, range(12))}
            again = {key: client.generate("x", routing_key=key, **GREEDY).version for key in first}
        assert first == again and set(first.values()) == {"a", "b"}
    finally:
        served.control("models.rollback", {"model": "tiny"})


def test_a_split_of_huge_weights_routes_each_key_as_the_split_of_equal_small_ones(served):
    keys = [f"key-{i}" for i in range(16)]
    routed = []
    for weight in (1e308, 1):
        served.control("models.split", {"model": "tiny", "weights": {"a": weight, "b": weight}})
        try:
            with served.client() as client:
                routed.append({key: client.generate("x", routing_key=key, **GREEDY).version for key in keys})
        finally:
            served.control("models.rollback", {"model": "tiny"})
    assert routed[0] == routed[1] and set(routed[1].values()) == {"a", "b"}


def test_unload_then_load_a_version_stops_and_starts_its_workers(served):
    with pytest.raises(MCPDError) as busy:   # the primary has traffic: it cannot go
        served.control("models.unload", {"model": "tiny", "version": "a"})
    assert busy.value.code == codes.CONFLICT
    loaded = served.control("models.load", {"model": "tiny", "version": "c"})
    with served.client() as client:   # waits in c's lane until its worker is up
        assert client.generate("hello", version="c", **GREEDY).version == "c"
    with SteadyLoad(served) as load:
        load.wait_for(4)
        unloaded = served.control("models.unload", {"model": "tiny", "version": "c"})
        load.wait_for(4)
    assert load.failed == [] and unloaded["workers"] == loaded["workers"] and unloaded["loaded"] is False
    status = served.status()
    processes = status["models"]["models"]["tiny"]["versions"]["c"]["processes"]
    assert [p["state"] for p in processes] == ["unloaded"]
    # its weights and KV went back to the device pool: no region has its worker as owner
    assert unloaded["pool_regions_freed"] == 2
    owners = {region["owner"] for pool in status["pools"] for region in pool["regions"]}
    assert not owners & set(unloaded["workers"])
    with served.client() as client, pytest.raises(MCPDError) as refused:
        client.generate("hello", version="c", **GREEDY)
    assert refused.value.code == codes.UNKNOWN_MODEL


def test_mcpctl_lists_models_and_versions(served):
    listed = served.mcpctl("models")
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()[1:]]
    assert [row[2] for row in rows] == ["a", "b", "c"] and rows[0][3] == "yes" and rows[0][4] == "primary"


def test_shadow_runs_a_copy_on_the_candidate_and_the_client_gets_the_primarys_answer(served):
    served.control("models.shadow", {"model": "tiny", "version": "b", "fraction": 1.0})
    try:
        with served.client() as client:
            primary = client.generate("hello", **GREEDY).token_ids
            answers = [client.generate("hello", **GREEDY) for _ in range(3)]
    finally:
        served.control("models.shadow", {"model": "tiny"})   # off
    assert all((a.version, a.token_ids) == ("a", primary) for a in answers)
    deadline = time.monotonic() + 60
    while (shadow := served.status()["models"]["models"]["tiny"]["shadow"])["compared"] < 4:
        assert time.monotonic() < deadline, shadow
    # The first test saw the two versions' greedy tokens for "hello" differ: no pair agrees.
    assert (shadow["candidate"], shadow["fraction"], shadow["agreement"]) == ("b", 0.0, 0.0)
    assert sum(shadow["shadow_latency"]["counts"]) == sum(shadow["primary_latency"]["counts"]) == 4


def test_http_requests_name_a_model_of_the_table(served):
    status, _, listed = raw(served, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in listed["data"]] == ["tiny"]
    status, _, answer = raw(served, "POST", "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2})
    assert status == 200 and answer["model"] == "tiny"
    status, _, refused = raw(served, "POST", "/v1/completions", {"model": "nope", "prompt": "hello"})
    assert status == 404
    with served.client() as client:
        expected = client.generate("hello", version="b", max_tokens=2, temperature=0).token_ids
    status, _, answer = raw(served, "POST", "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2,
                                                                 "temperature": 0, "version": "b", "logprobs": 0})
    assert status == 200 and answer["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in expected]
    status, _, refused = raw(served, "POST", "/v1/completions", {"model": "tiny", "prompt": "hello", "version": "zz"})
    assert status == 404 and "no version 'zz'" in refused["error"]["message"]


def test_a_slow_class_sends_its_hinted_requests_to_the_fast_version(fresh_daemon, checkpoints):
    """A class whose queueing p99 is over its fast_above_ms (here 1 µs: every request waits longer)
    steps onto the fast rung once its window has measured it: then a request with
    hints.prefer_speed goes to the model's fast version, one without stays on the default, and
    status and metrics say the rung is active. (Leaving it, with hysteresis, is tested on the
    scheduler's core: test_scheduler_models.py.)"""
    a, b = checkpoints
    d = fresh_daemon(metrics={"listen": "127.0.0.1:0"},
                     **{"models.tiny": {"default": "a", "fast": "b"}, "models.tiny.versions.a": {"path": str(a)},
                        "models.tiny.versions.b": {"path": str(b)},
                        "scheduler.classes.normal": {"rank": 1},
                        "scheduler.classes.hurry": {"rank": 2, "fast_above_ms": 0.001}})
    hurry = {"priority": "hurry", **GREEDY}
    with d.client() as client:
        assert client.generate("hello", hints={"prefer_speed": True}, **hurry).version == "a"   # not measured yet
        for _ in range(ADJUST_EVERY):   # the window measures p99 once per ADJUST_EVERY requests: each
            client.generate("hello", **hurry)   # status() below waits for fresh figures (up to 0.5 s)
        deadline = time.monotonic() + 60
        while "hurry" not in d.status()["scheduler"]["fast_rung"]["active"]:
            assert time.monotonic() < deadline, d.status()["scheduler"]["fast_rung"]
            client.generate("hello", **hurry)
        assert client.generate("hello", hints={"prefer_speed": True}, **hurry).version == "b"
        assert client.generate("hello", **hurry).version == "a"
        assert client.generate("hello", hints={"prefer_speed": True}, **GREEDY).version == "a"   # normal: no target
    samples = scrape(d)
    assert samples[("mcpd_fast_rung_active", (("class", "hurry"),))] == 1
    assert samples[("mcpd_fast_rung_active", (("class", "normal"),))] == 0
