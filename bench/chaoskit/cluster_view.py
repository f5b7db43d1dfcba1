"""What a cluster-aware client knows of the cluster: the nodes serving, as Redis's membership
records them (ownership.serving), less the nodes whose connection it saw drop (a SIGKILLed node stays in the membership until
its TTL lapses, seconds a client need not wait), and so each context's owner.

`route` is the one place that picks where a context's turn goes: the owner today; a front-end that
forwards to the owner makes any live node as good.
"""
from __future__ import annotations

import threading
import time

import redis
import zmq
from zmq.utils.monitor import recv_monitor_message

from mcpd.cluster.membership import Membership
from mcpd.cluster.ownership import Ownership, context_hash, serving

REFRESH_S = 0.2
UP_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED
DOWN_EVENTS = zmq.EVENT_DISCONNECTED


class ClusterView:
    def __init__(self, redis_url: str, endpoints: dict[str, str]):
        """`endpoints`: every node the client may meet, by id (their advertised ZeroMQ endpoints)."""
        self.membership = Membership(redis.Redis.from_url(redis_url, socket_timeout=0.5,
                                                          socket_connect_timeout=0.5), "chaos-client", 1.0)
        self.endpoints = endpoints
        self.down: set[str] = set()
        self.live: dict[str, float] = {}   # the serving nodes' weights, from the membership last read
        self.ownership: Ownership | None = None
        self.lock = threading.Lock()   # down and live change from two threads
        self.stopping = threading.Event()
        self.watchers = [threading.Thread(target=self._watch_connections, daemon=True),
                         threading.Thread(target=self._watch_membership, daemon=True)]

    def start(self) -> "ClusterView":
        for thread in self.watchers:
            thread.start()
        return self

    def close(self) -> None:
        self.stopping.set()
        for thread in self.watchers:
            thread.join(5)

    def owner(self, tenant: str, context_id: str) -> str | None:
        ownership = self.ownership
        return None if ownership is None else ownership.owner(context_hash(tenant, context_id))

    def wait_for(self, nodes: set[str], timeout_s: float = 60) -> None:
        """Until exactly `nodes` are live and connected."""
        deadline = time.monotonic() + timeout_s
        while self.serving() != nodes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"live {sorted(self.live)}, down {sorted(self.down)}; wanted {sorted(nodes)}")
            time.sleep(0.05)

    def serving(self) -> set[str]:
        with self.lock:
            return set(self.live) - self.down

    def _publish(self, live: dict[str, float] | None = None, up: str | None = None, down: str | None = None) -> None:
        with self.lock:
            if live is not None:
                self.live = live
            self.down.discard(up)
            if down is not None:
                self.down.add(down)
            weights = {node: weight for node, weight in self.live.items() if node not in self.down}
            self.ownership = Ownership(weights) if weights else None

    def _watch_membership(self) -> None:
        while not self.stopping.wait(REFRESH_S):
            try:
                reports = self.membership.live()
            except redis.RedisError:
                continue   # Redis down: the last view stands
            self._publish(live=serving(reports))

    def _watch_connections(self) -> None:
        """One probe connection per node: its drop marks the node down, its next handshake up."""
        context = zmq.Context.instance()
        probes, monitors = {}, {}
        for node, endpoint in self.endpoints.items():
            probe = context.socket(zmq.DEALER)
            probe.setsockopt(zmq.LINGER, 0)
            probe.setsockopt(zmq.RECONNECT_IVL, 50)
            monitors[probe.get_monitor_socket(UP_EVENTS | DOWN_EVENTS)] = node
            probe.connect(endpoint)
            probes[node] = probe
        poller = zmq.Poller()
        for monitor in monitors:
            poller.register(monitor, zmq.POLLIN)
        while not self.stopping.is_set():
            for monitor, _ in poller.poll(100):
                node = monitors[monitor]
                if recv_monitor_message(monitor)["event"] & UP_EVENTS:
                    self._publish(up=node)
                else:
                    self._publish(down=node)
        for probe in probes.values():
            probe.disable_monitor()
            probe.close(0)
        for monitor in monitors:
            monitor.close(0)


def route(view: ClusterView, tenant: str, context_id: str) -> str | None:
    """The node a context's turn is sent to: its owner among the nodes the client sees live."""
    return view.owner(tenant, context_id)
