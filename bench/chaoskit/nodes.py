"""The chaos run's cluster: three real daemons with [cluster] on one real redis-server, each on a
loopback port of its own that it advertises, and the kills: a node's every process at once (the
machine gone), or Redis's (its AOF keeps what it acknowledged)."""
from __future__ import annotations

import os
import signal
from contextlib import suppress

from mcpd.testing import Daemon, RedisServer, free_port


class ChaosCluster:
    def __init__(self, nodes: int):
        self.redis = RedisServer()
        self.daemons: dict[str, Daemon] = {f"node-{i}": _node(self.redis.url, f"node-{i}") for i in range(nodes)}

    @property
    def endpoints(self) -> dict[str, str]:
        return {node: daemon.endpoint for node, daemon in self.daemons.items()}

    def start(self) -> "ChaosCluster":
        self.redis.start()
        for daemon in self.daemons.values():
            daemon.start()
        return self

    def kill(self, node: str) -> None:
        """SIGKILL the node's supervisor and every child it has, together."""
        daemon = self.daemons[node]
        pids = [p["pid"] for p in daemon.processes() if p.get("pid")] + [daemon.process.pid]
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        daemon.process.wait()

    def restart(self, node: str) -> None:
        self.daemons[node].start()

    def close(self) -> None:
        for daemon in self.daemons.values():
            daemon.stop()
            daemon.cleanup()
        self.redis.cleanup()


def _node(redis_url: str, node_id: str) -> Daemon:
    """A daemon on a port chosen here, so that its [cluster] section can advertise it."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    daemon = Daemon(server={"tcp": endpoint}, cluster={"redis": redis_url, "node_id": node_id, "advertise_tcp": endpoint})
    daemon.port, daemon.endpoint = port, endpoint
    return daemon
