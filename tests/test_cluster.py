"""Real daemons sharing contexts through a real redis-server on loopback: an acknowledged change
is in Redis before its reply (the scheduler SIGKILLed right after), a second daemon with its own
state serves the context exactly, and with Redis killed every change is refused retryably, nothing
acknowledged is lost, and changes go on once it is back."""
import logging
import os
import signal
import urllib.request

import numpy as np
import pytest

from mcpd.cluster.redis_contexts import RedisContexts
from mcpd.config import ClusterConfig
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.testing import free_port

pytestmark = pytest.mark.slow
GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


def cluster_node(fresh_daemon, redis_server, name):
    return fresh_daemon(cluster={"redis": redis_server.url, "node_id": name})


def in_redis(redis_server, owner, context_id):
    return RedisContexts(ClusterConfig(redis=redis_server.url), logging.getLogger("test")).load(owner, context_id)


def test_an_acknowledged_change_is_in_redis_when_the_scheduler_dies_right_after(fresh_daemon, redis_server):
    daemon = cluster_node(fresh_daemon, redis_server, "a")
    with daemon.client(tenant="acme") as client:
        ctx = client.context("chat")
        ctx["w"] = np.arange(1000, dtype=np.float32)
        ctx.sync()
        ctx.generate("hello", **GREEDY)
        os.kill(daemon.pid_of("scheduler"), signal.SIGKILL)
    held = in_redis(redis_server, "acme", "chat")
    assert held.version == ctx.version == 2
    assert np.array_equal(held.fields["w"], ctx["w"]) and np.array_equal(held.tokens, ctx.tokens)


def test_a_second_daemon_serves_the_context_exactly(fresh_daemon, redis_server):
    first, second = cluster_node(fresh_daemon, redis_server, "a"), cluster_node(fresh_daemon, redis_server, "b")
    with first.client(tenant="acme") as client:
        ctx = client.context("chat")
        ctx["profile"] = "ada"
        ctx["w"] = np.linspace(0, 1, 256, dtype=np.float64)
        ctx.sync()
        ctx.generate("hello there", **GREEDY)
        del ctx["profile"]
        ctx.sync()
    with second.client(tenant="acme") as client:
        there = client.context("chat", create=False)
        assert there.version == ctx.version == 3 and there.keys() == ["w"]
        assert np.array_equal(there["w"], ctx["w"]) and np.array_equal(there.tokens, ctx.tokens)
        turn = there.generate(" and more", **GREEDY)
        assert turn.context.version == 4
    with pytest.raises(MCPDError) as other_tenant:
        with second.client(tenant="intruder") as client:
            client.context("chat", create=False)
    assert other_tenant.value.code == codes.NOT_FOUND


def test_redis_killed_refuses_changes_retryably_loses_nothing_and_changes_go_on(fresh_daemon, redis_server):
    daemon = cluster_node(fresh_daemon, redis_server, "a")
    with daemon.client(tenant="acme") as client:
        ctx = client.context("chat")
        ctx["n"] = 1
        ctx.sync()
        redis_server.kill()
        ctx["n"] = 2
        with pytest.raises(MCPDError) as refused:
            ctx.sync()
        assert refused.value.code == codes.UNAVAILABLE and refused.value.retry_after_ms > 0
        with pytest.raises(MCPDError) as turn:
            ctx.generate("hello", **GREEDY)
        assert turn.value.code == codes.UNAVAILABLE
        assert client.call("context.get", {"id": "chat"})["version"] == 1   # nothing changed
        redis_server.start()
        assert ctx.sync() == 2
        ctx.generate("hello", **GREEDY)
    held = in_redis(redis_server, "acme", "chat")
    assert held.version == 3 and held.fields["n"] == 2 and np.array_equal(held.tokens, ctx.tokens)


def test_nodes_see_each_other_and_a_stopped_node_leaves(fresh_daemon, redis_server):
    metrics_port = free_port()
    first = fresh_daemon(cluster={"redis": redis_server.url, "node_id": "a", "advertise_tcp": "tcp://127.0.0.1:1"},
                         metrics={"listen": f"127.0.0.1:{metrics_port}"})
    second = cluster_node(fresh_daemon, redis_server, "b")

    def live_nodes(daemon):
        return daemon.status()["cluster"]["nodes"]
    def b_serving(seen):   # b's heartbeat carries its ready worker's model and KV once it reported them
        return seen.get("b", {}).get("models") == ["default/default"] and seen["b"]["free_kv_blocks"] > 0
    first.wait_until(lambda: b_serving(live_nodes(first)), what="b live with its model and free KV")
    seen = live_nodes(first)
    assert set(seen) == {"a", "b"} and seen["a"]["tcp"] == "tcp://127.0.0.1:1" and seen["a"]["weight"] == 1.0
    assert "cluster node a  heartbeat ok  live nodes 2: a, b" in first.mcpctl("status").stdout
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
    assert "mcpd_cluster_live_nodes 2.0" in scraped and "mcpd_cluster_heartbeat_ok 1.0" in scraped
    assert "mcpd_cluster_redis_refusals_total 0.0" in scraped
    second.stop()
    first.wait_until(lambda: set(live_nodes(first)) == {"a"}, what="the stopped node gone")


def test_on_the_journal_alone_redis_down_changes_go_on_and_reach_redis_once_it_is_back(fresh_daemon, redis_server):
    daemon = fresh_daemon(cluster={"redis": redis_server.url, "node_id": "a", "when_redis_down": "journal"})
    with daemon.client(tenant="acme") as client:
        ctx = client.context("chat")
        redis_server.kill()
        ctx["n"] = 1
        assert ctx.sync() == 1
        ctx.generate("hello", **GREEDY)
        redis_server.start()
        daemon.wait_until(lambda: in_redis(redis_server, "acme", "chat").version == 2, what="Redis caught up")
    held = in_redis(redis_server, "acme", "chat")
    assert held.fields["n"] == 1 and np.array_equal(held.tokens, ctx.tokens)


def test_a_node_behind_takes_the_newer_copy_when_a_client_names_a_newer_version(fresh_daemon, redis_server):
    """Node a holds two contexts at version 1 while b moves them on (as when a was down and is
    back): a turn based on b's version, and a context.get since it, are served from b's."""
    first, second = cluster_node(fresh_daemon, redis_server, "a"), cluster_node(fresh_daemon, redis_server, "b")
    with first.client(tenant="acme") as client:
        for name in ("chat", "notes"):
            client.context(name).generate("hello", **GREEDY)
    with second.client(tenant="acme") as client:
        moved = {name: client.context(name, create=False) for name in ("chat", "notes")}
        for there in moved.values():
            there.generate(" and more", **GREEDY)
            assert there.version == 2
    with first.client(tenant="acme") as client:
        turn = client.generate(" again", context="chat", base=2, **GREEDY)
        assert turn.context.version == 3
        notes, frames = client.call_with_payload("context.get", {"id": "notes", "since": 2})
        assert notes["version"] == 2 and notes["changes"] == []
        chat = client.context("chat", create=False)
    assert np.array_equal(chat.tokens[:len(moved["chat"].tokens)], moved["chat"].tokens)
    assert np.array_equal(in_redis(redis_server, "acme", "chat").tokens, chat.tokens)
