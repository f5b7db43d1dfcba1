"""cluster.redis naming a Redis Cluster or a Sentinel-watched primary (mcpd/cluster/redis_url.py,
redis_client.py): the URL forms accepted and refused, and the store, journal and heartbeat in this
process against real redis-servers (three masters with cluster-enabled, and a sentinel watching
one): contexts and membership work, and with every server killed changes are refused retryably
and go on once they are back."""
import logging
import shutil
import subprocess
import time

import numpy as np
import pytest

from mcpd.cluster import redis_url
from mcpd.cluster.membership import Membership
from mcpd.cluster.node_report import NodeReport
from mcpd.cluster.redis_client import connect
from mcpd.config import from_dict
from mcpd.config_error import ConfigError
from mcpd.contexts.persistence import open_store
from mcpd.protocol import codes
from mcpd.protocol import delta as codec
from mcpd.protocol.codes import MCPDError
from mcpd.testing import RedisServer, free_port
from set_up_tools import require
from test_redis_contexts import grow, same

LOG = logging.getLogger("test")


def config_with(state_dir, url, **cluster):
    return from_dict({"server": {"state_dir": str(state_dir)},
                      "cluster": {"redis": url, "node_id": state_dir.name, **cluster}})


@pytest.mark.parametrize("url, kind, hosts, service, db", [
    ("redis+cluster://127.0.0.1:7000,127.0.0.1:7001", "cluster", (("127.0.0.1", 7000), ("127.0.0.1", 7001)), "", 0),
    ("redis+sentinel://127.0.0.1:26379/prime", "sentinel", (("127.0.0.1", 26379),), "prime", 0),
    ("redis+sentinel://a:1,[::1]:2/prime/3", "sentinel", (("a", 1), ("::1", 2)), "prime", 3),
    ("redis://127.0.0.1:6379/2", "server", (), "", 0),
])
def test_cluster_and_sentinel_urls_are_read(url, kind, hosts, service, db):
    where = redis_url.parse(url)
    assert (where.kind, where.hosts, where.service, where.db) == (kind, hosts, service, db)


def test_the_data_nodes_credentials_are_read_from_the_url():
    where = redis_url.parse("rediss+cluster://mcpd:p%40ss@h:1")
    assert (where.username, where.password, where.tls) == ("mcpd", "p@ss", True)


@pytest.mark.parametrize("url, shown", [
    ("redis://:s3cret@h:1/0", "redis://:***@h:1/0"),
    ("redis+cluster://mcpd:s3cret@h:1,h:2", "redis+cluster://mcpd:***@h:1,h:2"),
    ("redis+sentinel://a:s3c:ret@h:1/prime", "redis+sentinel://a:***@h:1/prime"),
    ("unix:///run/redis.sock?db=0&password=s3cret", "unix:///run/redis.sock?db=0&password=***"),
    ("redis://h:1/0", "redis://h:1/0"),
    ("redis+cluster://mcpd:p@ss@h:1", "redis+cluster://mcpd:***@h:1"),   # an @ left unquoted in the password
    ("redis://m@cpd:s3cret@h:1/0", "redis://m@cpd:***@h:1/0"),
])
def test_the_logged_url_shows_no_password(url, shown):
    assert redis_url.redacted(url) == shown


@pytest.mark.parametrize("url", [
    "redis+cluster://h", "redis+cluster://h:0", "redis+cluster://h:65536", "redis+cluster://:1",
    "redis+cluster://h:1,", "redis+cluster://h:1/0", "redis+sentinel://h:1", "redis+sentinel://h:1/",
    "redis+sentinel://h:1/s/16", "redis+sentinel://h:1/s/x", "http://h:1", "redis+cluster://h:1\n",
    "redis+cluster://" + ",".join(["h:1"] * 65),
])
def test_a_malformed_cluster_or_sentinel_url_is_a_config_error(url, tmp_path):
    with pytest.raises(ConfigError):
        config_with(tmp_path, url)


class RedisSentinel:
    """A real redis-server in sentinel mode on a free loopback port, watching `primary` as "prime"."""

    def __init__(self, primary: RedisServer):
        self.port = free_port()
        self.conf = primary.root / "sentinel.conf"
        self.conf.write_text(f"bind 127.0.0.1\nport {self.port}\ndir {primary.root}\n"
                             f"sentinel monitor prime 127.0.0.1 {primary.port} 1\n")
        self.process = subprocess.Popen(["redis-server", str(self.conf), "--sentinel"],
                                        stdout=open(primary.root / "sentinel.log", "ab"), stderr=subprocess.STDOUT)
        self.url = f"redis+sentinel://127.0.0.1:{self.port}/prime"
        _wait_for(lambda: _answers(["-p", str(self.port), "sentinel", "get-master-addr-by-name", "prime"],
                                   str(primary.port)), "the sentinel")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


class RedisClusterServers:
    """Three real redis-servers with cluster-enabled, joined into one Redis Cluster (every slot served)."""

    def __init__(self):
        # The bus port named: Redis's default, the port + 10000, fails past 55535 or may be taken.
        self.servers = [RedisServer("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                    "--cluster-port", str(free_port())) for _ in range(3)]
        try:
            for server in self.servers:
                server.start()
            nodes = [f"127.0.0.1:{server.port}" for server in self.servers]
            subprocess.run(["redis-cli", "--cluster", "create", *nodes, "--cluster-yes"], check=True,
                           capture_output=True, timeout=60)
            for server in self.servers:
                _wait_for(lambda: _answers(["-p", str(server.port), "cluster", "info"], "cluster_state:ok"),
                          "the cluster")
        except BaseException:
            self.cleanup()
            raise
        self.url = "redis+cluster://" + ",".join(nodes[:2])   # any of its nodes lead to the rest

    def cleanup(self) -> None:
        for server in self.servers:
            server.cleanup()


def _answers(command: list[str], expected: str) -> bool:
    answer = subprocess.run(["redis-cli", "-h", "127.0.0.1", *command], capture_output=True, text=True, timeout=10)
    return expected in answer.stdout


def _wait_for(ready, what: str) -> None:
    deadline = time.monotonic() + 30
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up in 30 s")
        time.sleep(0.1)


@pytest.fixture
def sentinel(redis_server):
    watcher = RedisSentinel(redis_server)
    yield watcher
    watcher.stop()


@pytest.fixture
def redis_cluster():
    require(shutil.which("redis-server"), "redis-server", "`make setup-test` installs Debian's package")
    servers = RedisClusterServers()
    yield servers
    servers.cleanup()


@pytest.mark.parametrize("topology", ["sentinel", "redis_cluster"])
def test_contexts_and_membership_work_through_cluster_and_sentinel_urls(topology, tmp_path, request, caplog):
    url = request.getfixturevalue(topology).url
    first = open_store(config_with(tmp_path / "a", url, compact_after_bytes=1), None, LOG)
    made = grow(first.store)
    for version in range(3, 6):   # each commit past compact_after_bytes folds the log into a snapshot
        first.store.update("t", "c", version, [codec.diff("w", made.fields["w"], made.fields["w"] + 1)])
    second = open_store(config_with(tmp_path / "b", url), None, LOG)
    assert same(second.store.get("t", "c"), made) and first.shared.stats().folded >= 1
    assert np.array_equal(second.store.get("t", "c").fields["w"], np.arange(64, dtype=np.float32) * 2 + 3)
    second.store.drop("t", "c")
    third = open_store(config_with(tmp_path / "c", url), None, LOG)
    assert third.shared.load("t", "c") is None
    assert "maxmemory-policy" not in caplog.text   # read through either client: noeviction
    membership = Membership(connect(config_with(tmp_path, url).cluster), "n1", 5.0)
    membership.beat({"weight": 1.0})
    seen = membership.live()
    assert 0 <= seen["n1"].age_ms < 30_000 and seen == {"n1": NodeReport(weight=1.0, age_ms=seen["n1"].age_ms)}
    for node in (first, second, third):
        node.journal.close()


def _servers_of(topology, request) -> list[RedisServer]:
    return request.getfixturevalue(topology).servers if topology == "redis_cluster" else [
        request.getfixturevalue("redis_server")]


@pytest.mark.parametrize("topology", ["sentinel", "redis_cluster"])
def test_with_every_server_down_changes_are_refused_retryably_and_go_on_once_back(topology, tmp_path, request):
    url = request.getfixturevalue(topology).url
    first = open_store(config_with(tmp_path / "a", url), None, LOG)
    first.store.open("t", "c")
    servers = _servers_of(topology, request)
    for server in servers:
        server.kill()
    with pytest.raises(MCPDError) as refused:
        first.store.update("t", "c", 0, [codec.diff("n", None, 1)])
    assert refused.value.code == codes.UNAVAILABLE and first.store.get("t", "c").version == 0
    for server in servers:
        server.start()
    for server in servers:
        _wait_for(lambda: _answers(["-p", str(server.port), "info", "persistence"], "loading:0"), "the server")
    if topology == "redis_cluster":
        for server in servers:
            _wait_for(lambda: _answers(["-p", str(server.port), "cluster", "info"], "cluster_state:ok"), "the cluster")
    first.store.update("t", "c", 0, [codec.diff("n", None, 1)])
    assert open_store(config_with(tmp_path / "b", url), None, LOG).store.get("t", "c").fields["n"] == 1
    first.journal.close()
