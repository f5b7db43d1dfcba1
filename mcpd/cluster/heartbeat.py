"""This node's heartbeat: registers it in Redis every cluster.heartbeat_s with its endpoints,
weight and latest load (membership.py), from a thread of its own, so that a slow or dead Redis
never stalls the scheduler's loop, and keeps the live nodes it saw last for `status`.

The scheduler's loop hands it a fresh load report at every stats interval (update); the thread
only reads the reference, which the loop replaces whole.
"""
from __future__ import annotations

import logging
import threading

import redis

from mcpd.cluster.membership import Membership
from mcpd.cluster.redis_client import connect
from mcpd.config import ClusterConfig


class Heartbeat:
    def __init__(self, config: ClusterConfig, log: logging.Logger, curve_key: str = ""):
        """`curve_key`: this node's CURVE server key with CURVE on, for the nodes that forward to it."""
        self.membership = Membership(connect(config), config.node_name, config.node_ttl_s)
        self.interval_s = config.heartbeat_s
        self.identity = {"tcp": config.advertise_tcp, "http": config.advertise_http, "weight": config.weight,
                         "curve_key": curve_key}
        self.log = log
        self.load: dict = {}
        self.nodes: dict[str, dict] = {}   # the live nodes as last seen, by id
        self.failing: str | None = None    # why the last heartbeat did not reach Redis
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cluster-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self.thread.start()
        return self

    def update(self, load: dict) -> None:
        self.load = load

    def close(self) -> None:
        """Stop beating and leave the live nodes at once (a stop, not a crash: no one waits out the TTL)."""
        self.stopping.set()
        self.thread.join(self.interval_s + 1)
        try:
            self.membership.leave()
        except redis.RedisError as e:
            self.log.warning("could not leave the cluster's live nodes (%s): this node lapses after its TTL", e)

    def _run(self) -> None:
        while not self.stopping.is_set():
            self._beat()
            self.stopping.wait(self.interval_s)

    def _beat(self) -> None:
        try:
            self.membership.beat({**self.identity, **self.load})
            self.nodes = self.membership.live()
        except redis.RedisError as e:
            if self.failing is None:
                self.log.error("cluster heartbeat cannot reach Redis (%s): other nodes will count this one gone", e)
            self.failing = str(e)
            return
        if self.failing is not None:
            self.log.info("cluster heartbeat reaches Redis again")
            self.failing = None

    def stats(self) -> dict:
        return {"node": self.membership.node_id, "heartbeat": self.failing or "ok", "nodes": self.nodes}
