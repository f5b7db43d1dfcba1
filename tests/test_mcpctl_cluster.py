"""`mcpctl cluster` against real daemons and a real redis-server on loopback: a line saying so
when clustering is off; with two nodes, each node's endpoints, heartbeat, load, models and share of
the recently used contexts, Redis's round trip and lag, and a SIGKILLed node listed as gone."""
import json
import os
import signal

import pytest

from mcpd.cli.cluster import OFF
from mcpd.cluster.membership import Membership
from mcpd.cluster.ownership import Ownership, context_hash
from mcpd.testing import RedisServer

pytestmark = pytest.mark.slow
IDS = [f"c{i}" for i in range(10)]


def ctl(daemon, *args):
    done = daemon.mcpctl("cluster", *args)
    assert done.returncode == 0, (done.stdout, done.stderr)
    return json.loads(done.stdout) if "--json" in args else done.stdout


def rows(text):
    """The node table's rows, by node id."""
    lines = text.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("NODE")))
    return {line.split()[0]: line.split() for line in lines[header + 1:]}


def test_clustering_off_says_so(fresh_daemon):
    daemon = fresh_daemon()
    assert ctl(daemon).strip() == OFF
    assert ctl(daemon, "--json") == {"enabled": False, "contexts_behind": 0}


def test_config_masks_the_redis_password(fresh_daemon):
    """`config` (and `mcpctl config`) shows the effective configuration: not Redis's password."""
    server = RedisServer("--requirepass", "pw-s3cret").start()
    try:
        daemon = fresh_daemon(cluster={"redis": f"redis://:pw-s3cret@127.0.0.1:{server.port}/0", "node_id": "a"})
        with daemon.client(tenant="acme") as client:
            client.context("c0")   # the node really talks to Redis with that password
        config = daemon.control("config")["config"]
        assert config["cluster"]["redis"] == f"redis://:***@127.0.0.1:{server.port}/0"
        shown = daemon.mcpctl("config", "--json")
        assert shown.returncode == 0 and "pw-s3cret" not in shown.stdout and "***" in shown.stdout
    finally:
        server.cleanup()


def test_nodes_their_load_their_share_of_recent_contexts_and_a_killed_node_gone(fresh_daemon, redis_server):
    beats = {"redis": redis_server.url, "heartbeat_s": 0.2, "node_ttl_s": 1.0}
    a = fresh_daemon(cluster={**beats, "node_id": "a", "advertise_tcp": "tcp://127.0.0.1:7001",
                              "advertise_http": "http://127.0.0.1:7002"})
    b = fresh_daemon(cluster={**beats, "node_id": "b", "weight": 3.0})
    with a.client(tenant="acme") as client:
        for context_id in IDS:
            client.context(context_id)
    ownership = Ownership({"a": 1.0, "b": 3.0})
    owners = {name: sum(ownership.owner(context_hash("acme", i)) == name for i in IDS) for name in "ab"}

    def counted(view):   # b's own heartbeat carries its ready worker's model once it reported it
        return view["owners"] == owners and view["nodes"]["b"].get("models") == ["default/default"]
    b.wait_until(lambda: counted(ctl(b, "--json")), what="b counted the owners of a's contexts")
    view = ctl(b, "--json")
    assert view["enabled"] and view["node"] == "b" and view["heartbeat"] == "ok" and view["contexts_behind"] == 0
    assert view["recent_indexed"] == len(IDS) and view["redis_rtt_ms"] > 0
    assert view["nodes"]["a"]["tcp"] == "tcp://127.0.0.1:7001" and view["nodes"]["b"]["weight"] == 3.0
    assert 0 <= view["nodes"]["a"]["age_ms"] < 10_000
    text = ctl(b)
    assert "cluster node b  heartbeat ok  live nodes 2" in text and "contexts behind 0" in text
    table = rows(text)
    assert table["a"][1:2] == ["yes"] and table["a"][3:5] == ["tcp://127.0.0.1:7001", "http://127.0.0.1:7002"]
    assert table["a"][-1] == str(owners["a"]) and table["b"][-1] == str(owners["b"])
    assert table["b"][-2] == "default/default"   # the models b's ready worker serves
    # A heartbeat anyone with Redis's address could write: shown quoted, never as control sequences.
    forged = Membership(redis_server.client(), "forged\x1b[2J", 30)
    forged.beat({"tcp": "\x1b]0;owned\x07", "weight": 1.0, "models": ["\x1b[2J"]})
    b.wait_until(lambda: "forged\x1b[2J" in ctl(b, "--json")["nodes"], what="b saw the forged node")
    text = ctl(b)
    assert "\x1b" not in text and rows(text)["'forged\\x1b[2J'"][3] == "'\\x1b]0;owned\\x07'"
    forged.leave()
    os.kill(a.process.pid, signal.SIGKILL)
    a.process.wait()
    b.wait_until(lambda: "a" in ctl(b, "--json")["gone"], what="b saw a gone")
    assert rows(ctl(b))["a"][1] == "gone" and "live nodes 1" in ctl(b)
