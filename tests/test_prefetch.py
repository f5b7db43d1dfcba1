"""Warm start in a cluster, with real daemons and a real redis-server on loopback: a node that
starts prefetches the recently used contexts it owns, and a node whose peer is SIGKILLed prefetches
the ones it now owns, before any request for them, skipping index entries no node could have
written; their next turn is served from its own copy and is exact."""
import os
import signal

import numpy as np
import pytest

from mcpd.cluster.ownership import Ownership, context_hash
from mcpd.cluster.recency import KEY as RECENT

pytestmark = pytest.mark.slow
GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
FAST_BEATS = {"heartbeat_s": 0.2, "node_ttl_s": 1.0}
IDS = [f"chat-{i}" for i in range(8)]
FIELD_FLOATS = 1 << 18   # 1 MiB a context: what Redis would hear again if a prefetch wrote it back


def node(fresh_daemon, redis_server, name):
    return fresh_daemon(cluster={"redis": redis_server.url, "node_id": name, **FAST_BEATS})


def chat_on(daemon, ids):
    """A field and two turns on each context; their token histories by id."""
    with daemon.client(tenant="acme") as client:
        histories = {}
        for context_id in ids:
            ctx = client.context(context_id)
            ctx["w"] = np.full(FIELD_FLOATS, len(histories), np.float32)
            ctx.generate("hello", **GREEDY)
            ctx.generate(" and then", **GREEDY)
            histories[context_id] = ctx.tokens.copy()
    return histories


def cluster_of(daemon):
    return daemon.status()["cluster"]


def held(daemon):
    with daemon.client(tenant="acme") as client:
        return {c["id"] for c in client.call("context.list", {})["contexts"]}


def sigkill(daemon):
    scheduler = daemon.pid_of("scheduler")
    os.kill(daemon.process.pid, signal.SIGKILL)
    os.kill(scheduler, signal.SIGKILL)
    daemon.process.wait()


def test_a_node_that_starts_prefetches_the_recent_contexts_it_owns(fresh_daemon, redis_server):
    a = node(fresh_daemon, redis_server, "a")
    chat_on(a, IDS)
    a.wait_until(lambda: redis_server.client().zcard(RECENT) == len(IDS), what="the contexts indexed")
    b = node(fresh_daemon, redis_server, "b")
    ownership = Ownership({"a": 1.0, "b": 1.0})
    owned_by_b = {i for i in IDS if ownership.owner(context_hash("acme", i)) == "b"}
    assert 0 < len(owned_by_b) < len(IDS)   # the ids split between the two nodes
    b.wait_until(lambda: cluster_of(b)["prefetch"]["prefetched"] == len(owned_by_b), what="b's prefetch")
    assert held(b) == owned_by_b and cluster_of(b)["owners"] == {"a": len(IDS) - len(owned_by_b),
                                                                  "b": len(owned_by_b)}
    assert b.status()["contexts"]["redis"]["loaded"] == 0   # no request brought them in


def test_a_peer_sigkilled_its_contexts_are_prefetched_before_any_request_and_their_next_turn_is_exact(
        fresh_daemon, redis_server):
    b = node(fresh_daemon, redis_server, "b")
    a = node(fresh_daemon, redis_server, "a")
    b.wait_until(lambda: set(cluster_of(b)["nodes"]) == {"a", "b"}, what="b sees a")
    histories = chat_on(a, IDS)
    a.wait_until(lambda: redis_server.client().zcard(RECENT) == len(IDS), what="the contexts indexed")
    # Entries no node writes: not UTF-8, two colons, a bad escape, and a well-formed name Redis holds no context of.
    redis_server.client().zadd(RECENT, {b"\xff:x": 1e15, b"acme:a:b": 1e15, b"acme%zz:x": 1e15, b"acme:ghost": 1e15})
    received = redis_server.client().info("stats")["total_net_input_bytes"]
    sigkill(a)
    b.wait_until(lambda: cluster_of(b)["prefetch"]["prefetched"] == len(IDS), what="a's contexts prefetched")
    # Only heartbeats reached Redis meanwhile: the contexts read from it were not written back.
    assert redis_server.client().info("stats")["total_net_input_bytes"] - received < FIELD_FLOATS * 4
    status = b.status()
    assert "a" in status["cluster"]["gone"] and status["contexts"]["redis"]["loaded"] == 0
    assert status["cluster"]["prefetch"]["last_pass"]["trigger"] == "nodes left: a"
    assert held(b) == set(IDS) and status["cache"]["contexts"] >= len(IDS)
    with b.client(tenant="acme") as client:
        for context_id in IDS:
            there = client.context(context_id, create=False)
            assert there.version == 3 and np.array_equal(there.tokens, histories[context_id])
            assert np.array_equal(there["w"], np.full(FIELD_FLOATS, IDS.index(context_id), np.float32))
            turn = there.generate(" more", **GREEDY)
            # The same history in a context of its own, made on b from its token ids, answers alike.
            twin = client.context(context_id + "-twin")
            twin["tokens"] = histories[context_id]
            twin.sync()
            assert turn.token_ids == twin.generate(" more", **GREEDY).token_ids
            assert np.array_equal(there.tokens, twin.tokens)
    assert b.status()["contexts"]["redis"]["loaded"] == 0   # every turn found b's own copy
