"""Cluster membership in a real redis-server (mcpd/cluster/membership.py), in this process: a
heartbeat registers a node with its report, a node that leaves is gone at once, one that stops
beating lapses after its TTL, and hostile node ids stay in the membership's hash tag."""
import time

import msgspec
import pytest

from mcpd.cluster.membership import Membership, node_key
from mcpd.cluster.node_report import NodeReport


def test_nodes_register_with_their_reports_and_leave(redis_server):
    client = redis_server.client()
    a, b = Membership(client, "a", 30), Membership(client, "b", 30)
    a.beat({"queued": 3, "models": ["default/default"]})
    b.beat({"queued": 0, "models": []})
    seen = a.live()
    assert all(0 <= report.age_ms < 30_000 for report in seen.values())
    assert {node_id: msgspec.structs.replace(report, age_ms=None) for node_id, report in seen.items()} == {
        "a": NodeReport(queued=3, models=["default/default"]), "b": NodeReport(queued=0, models=[])}
    a.beat({"queued": 1, "models": []})
    assert b.live()["a"].queued == 1   # the newest report
    b.leave()
    assert list(a.live()) == ["a"] and not client.exists(node_key("b"))


def test_a_node_that_stops_beating_lapses(redis_server):
    client = redis_server.client()
    Membership(client, "silent", 0.2).beat({})
    watcher = Membership(client, "watcher", 30)
    watcher.beat({})
    deadline = time.monotonic() + 10
    while "silent" in watcher.live():
        assert time.monotonic() < deadline, "a node that stopped beating is still live"
        time.sleep(0.05)
    assert list(watcher.live()) == ["watcher"] and client.zscore("mcpd:{nodes}", "silent") is None


def test_a_node_id_with_braces_keeps_the_membership_s_hash_tag():
    key = node_key("x}{y")
    assert key[key.index("{") + 1:key.index("}")] == "nodes"


def test_a_record_that_is_not_a_report_is_left_out(redis_server):
    client = redis_server.client()
    watcher = Membership(client, "watcher", 30)
    watcher.beat({"queued": 0})
    Membership(client, "forged", 30).beat({})
    client.hset(node_key("forged"), "report", b"\xc1 not msgpack")
    assert list(watcher.live()) == ["watcher"]


@pytest.mark.parametrize("report", [{"weight": "9"}, {"queued": True}, {"queued": "1"}, {"models": "m/a"},
                                    {"tcp": 7}, {"curve_key": None}, ["not", "a", "map"]])
def test_a_report_of_the_wrong_shape_is_left_out_with_a_log_line(redis_server, report, caplog):
    client = redis_server.client()
    watcher = Membership(client, "watcher", 30)
    watcher.beat({"queued": 0, "weight": 1.0})
    Membership(client, "forged", 30).beat(report)
    assert list(watcher.live()) == ["watcher"] and list(watcher.live()) == ["watcher"]
    said = [r for r in caplog.records if "'forged'" in r.getMessage() and "left out" in r.getMessage()]
    assert len(said) == 1   # once, not at every heartbeat


@pytest.mark.parametrize("stamp", [b"9" * 23, b"99999999999999999", b"-5", b"1e3", b""])
def test_a_forged_heartbeat_stamp_gives_no_age_and_the_report_still_encodes(redis_server, stamp):
    client = redis_server.client()
    watcher = Membership(client, "watcher", 30)
    watcher.beat({"queued": 0})
    Membership(client, "forged", 30).beat({"queued": 1})
    client.hset(node_key("forged"), "at", stamp)   # a stamp from the future, past int64, or not a number
    forged = watcher.live()["forged"]
    assert forged.queued == 1 and forged.age_ms is None
    msgspec.msgpack.encode(forged)   # the status report that carries it must still encode
