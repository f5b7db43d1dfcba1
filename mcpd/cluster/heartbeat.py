"""This node's heartbeat: registers it in Redis every cluster.heartbeat_s with its endpoints,
weight and latest load (membership.py), from a thread of its own, so that a slow or dead Redis
never stalls the scheduler's loop, and keeps the live nodes it saw last for `status`. Each beat
also writes the contexts this node used since the last one to the recency index (recency.py),
and tells the prefetch (prefetch.py) the live nodes, and whether this node just started or saw
nodes leave.

The scheduler's loop hands it a fresh load report at every stats interval (update); the thread
only reads the reference, which the loop replaces whole, and the contexts used come through a
queue. What stats() reads is likewise replaced whole, never changed in place.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

import msgspec
import redis

from mcpd.cluster.membership import Membership
from mcpd.cluster.node_report import GoneNode, NodeReport
from mcpd.cluster.recency import RecentContexts
from mcpd.cluster.redis_client import REDIS_ERRORS
from mcpd.config import ClusterConfig

REMEMBERED_GONE = 16   # nodes seen to leave that `status` still lists


class Heartbeat:
    def __init__(self, config: ClusterConfig, client: redis.Redis, recent: RecentContexts, observer,
                 log: logging.Logger, curve_key: str = ""):
        """`observer(nodes, trigger)` hears the live nodes after each beat (Prefetch.observe);
        `curve_key`: this node's CURVE server key with CURVE on, for the nodes that forward to it."""
        self.membership = Membership(client, config.node_name, config.node_ttl_s, log)
        self.recent, self.observer = recent, observer
        self.interval_s = config.heartbeat_s
        self.identity = {"tcp": config.advertise_tcp, "http": config.advertise_http, "weight": config.weight,
                         "curve_key": curve_key}
        self.log = log
        self.load: dict = {}
        self.used: queue.SimpleQueue = queue.SimpleQueue()   # (used, dropped) lists from the loop
        self.unwritten: tuple[dict, dict] = ({}, {})   # to the recency index, when Redis missed them
        self.nodes: dict[str, NodeReport] = {}   # the live nodes as last seen, by id
        self.gone: dict[str, GoneNode] = {}      # nodes seen to leave: their last report and when
        self.indexed = 0                   # contexts in the recency index, at its last write
        self.rtt_ms: float | None = None   # the last heartbeat's round trips to Redis
        self.failing: str | None = None    # why the last heartbeat did not reach Redis
        self.started = False               # a beat reached Redis since this node started
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cluster-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self.thread.start()
        return self

    def update(self, load: dict, used: list[tuple[str, str]], dropped: list[tuple[str, str]]) -> None:
        self.load = load
        if used or dropped:
            self.used.put((used, dropped))

    def close(self) -> None:
        """Stop beating and leave the live nodes at once (a stop, not a crash: no one waits out the TTL)."""
        self.stopping.set()
        self.thread.join(self.interval_s + 1)
        try:
            self.membership.leave()
        except REDIS_ERRORS as e:
            self.log.warning("could not leave the cluster's live nodes (%s): this node lapses after its TTL", e)

    def _run(self) -> None:
        while not self.stopping.is_set():
            self._beat()
            self.stopping.wait(self.interval_s)

    def _beat(self) -> None:
        try:
            started = time.perf_counter()
            self.membership.beat({**self.identity, **self.load})
            nodes = self.membership.live()
            self.rtt_ms = round((time.perf_counter() - started) * 1000, 3)
            self._write_used()
        except REDIS_ERRORS as e:
            if self.failing is None:
                self.log.error("cluster heartbeat cannot reach Redis (%s): other nodes will count this one gone", e)
            self.failing = str(e)
            return
        if self.failing is not None:
            self.log.info("cluster heartbeat reaches Redis again")
            self.failing = None
        self._see(nodes)

    def _see(self, nodes: dict[str, NodeReport]) -> None:
        """Take the live nodes in; tell the observer, with why to prefetch if this node just
        started or nodes left."""
        left = sorted(set(self.nodes) - set(nodes))
        now = time.time()
        gone = {node_id: report for node_id, report in self.gone.items() if node_id not in nodes}
        gone.update({node_id: GoneNode(**msgspec.structs.asdict(self.nodes[node_id]), gone_at=now) for node_id in left})
        self.gone = dict(list(gone.items())[-REMEMBERED_GONE:])
        self.nodes = nodes
        trigger = None if self.started else "start"
        if left:
            self.log.warning("cluster nodes gone: %s; this node takes over the contexts it now owns", ", ".join(left))
            trigger = "nodes left: " + ", ".join(left)
        self.started = True
        self.observer(nodes, trigger)

    def _write_used(self) -> None:
        """Write the contexts used since the last beat to the recency index; kept for the next
        beat when Redis misses them (the newest recent.bound of each kind)."""
        used, dropped = self.unwritten
        while not self.used.empty():
            more_used, more_dropped = self.used.get()
            for key in more_dropped:
                used.pop(key, None)
                dropped[key] = None
            for key in more_used:
                dropped.pop(key, None)
                used.pop(key, None)
                used[key] = None
        self.unwritten = _newest(used, self.recent.bound), _newest(dropped, self.recent.bound)
        self.indexed = self.recent.record(*self.unwritten)
        self.unwritten = ({}, {})

    def stats(self) -> dict:
        """ClusterStats' fields that the heartbeat knows."""
        now = time.time()
        return {"node": self.membership.node_id, "heartbeat": self.failing or "ok", "nodes": self.nodes,
                "gone": {node_id: msgspec.structs.replace(report, gone_s=round(now - report.gone_at, 1))
                         for node_id, report in self.gone.items()},
                "redis_rtt_ms": self.rtt_ms, "recent_indexed": self.indexed}


def _newest(keys: dict, bound: int) -> dict:
    return keys if len(keys) <= bound else dict.fromkeys(list(keys)[-bound:])
