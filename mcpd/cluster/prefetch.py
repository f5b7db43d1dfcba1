"""Warm start: when this node starts, or owns more contexts because another node left, it loads
the contexts it now owns that were most recently used (the recency index, recency.py) from Redis,
so that their first turn finds them in its host cache instead of waiting on Redis.

Bounded and out of the way: at most cluster.prefetch_contexts a pass, read by a thread of its own
one at a time, each handed to the scheduler's loop (which alone touches the store) through a
one-slot queue and a wake-up socket, so the loop adopts one context per wake-up between requests.
A newer trigger (another node left) ends the pass at the next context and starts one over the new
owners. The same thread counts, every pass and every RECOUNT_BEATS heartbeats, how many of the
indexed contexts each live node owns (for `mcpctl cluster`).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np
import zmq

from mcpd.cluster.node_report import NodeReport, PrefetchPass
from mcpd.cluster.ownership import Ownership, context_hash, weights as node_weights
from mcpd.cluster.recency import RecentContexts
from mcpd.cluster.redis_client import REDIS_ERRORS
from mcpd.cluster.redis_contexts import RedisContexts
from mcpd.contexts.context import Context
from mcpd.protocol.codes import MCPDError

WAKEUP = "inproc://mcpd-cluster-prefetch"
RECOUNT_BEATS = 30   # a recount reads the whole index: rarely, by every node


class Prefetch:
    def __init__(self, zmq_context: zmq.Context, recent: RecentContexts, shared: RedisContexts, node_id: str,
                 limit: int, held: Callable[[tuple[str, str]], bool], interval_s: float, log: logging.Logger):
        self.zmq_context, self.recent, self.shared, self.node_id = zmq_context, recent, shared, node_id
        self.limit, self.held, self.recount_s, self.log = limit, held, interval_s * RECOUNT_BEATS, log
        self.ready: queue.Queue[Context] = queue.Queue(maxsize=1)
        self.wakeup = zmq_context.socket(zmq.PULL)   # the scheduler's loop polls it
        self.wakeup.bind(WAKEUP)
        self.nodes: dict[str, NodeReport] = {}    # the live nodes as last seen
        self.trigger: str | None = None           # why the next pass prefetches; None: only count owners
        self.trigger_lock = threading.Lock()      # the heartbeat's thread sets it, this one takes it
        self.owners: dict[str, int] = {}          # indexed contexts each live node owns, at the last count
        self.last_pass: PrefetchPass | None = None
        self.wake, self.stopping = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, name="cluster-prefetch", daemon=True)

    def start(self) -> "Prefetch":
        self.thread.start()
        return self

    def observe(self, nodes: dict[str, NodeReport], trigger: str | None) -> None:
        """From the heartbeat: the live nodes, and why to prefetch now (this node started, nodes
        left), or None."""
        self.nodes = nodes
        if trigger is not None and self.limit:
            with self.trigger_lock:
                self.trigger = trigger
            self.wake.set()

    def take(self) -> Context | None:
        """On the scheduler's loop, once its wake-up socket is readable: the next context to adopt."""
        while self.wakeup.poll(0):
            self.wakeup.recv()
        try:
            return self.ready.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        self.stopping.set()
        self.wake.set()
        self.thread.join(5)
        self.wakeup.close(linger=0)

    def _run(self) -> None:
        waking = self.zmq_context.socket(zmq.PUSH)
        waking.connect(WAKEUP)
        try:
            while not self.stopping.is_set():
                self.wake.wait(self.recount_s)
                self.wake.clear()
                self._pass(waking)
        finally:
            waking.close(linger=0)

    def _pass(self, waking: zmq.Socket) -> None:
        with self.trigger_lock:
            trigger, self.trigger = self.trigger, None
        nodes = self.nodes
        weights = node_weights(nodes)
        if self.stopping.is_set() or self.node_id not in weights:
            return
        try:
            recent = list(self.recent.newest())
            owned = self._count_owners(recent, Ownership(weights))
            if trigger is not None:
                self._prefetch(owned, trigger, waking)
        except (*REDIS_ERRORS, MCPDError) as e:
            self.log.warning("cluster prefetch: Redis could not be read (%s); the next takeover tries again", e)

    def _count_owners(self, recent: list[tuple[str, str]], ownership: Ownership) -> list[tuple[str, str]]:
        """Count each node's share of the indexed contexts; return this node's, the newest first."""
        hashes = np.fromiter((context_hash(*key) for key in recent), np.uint64, len(recent))
        owner = ownership.owners(hashes)
        counts = np.bincount(owner, minlength=len(ownership.nodes))
        self.owners = dict(zip(ownership.nodes, counts.tolist()))
        mine = ownership.nodes.index(self.node_id)
        return [key for key, index in zip(recent, owner.tolist()) if index == mine]

    def _prefetch(self, owned: list[tuple[str, str]], trigger: str, waking: zmq.Socket) -> None:
        started, wanted, loaded = time.monotonic(), [key for key in owned if not self.held(key)], 0
        for key in wanted[:self.limit]:
            if self.trigger is not None or self.stopping.is_set():   # a newer takeover: its pass follows
                break
            context = self.shared.read(*key)
            if context is not None and self._hand_over(context, waking):
                loaded += 1
        self.last_pass = PrefetchPass(trigger, len(owned), min(len(wanted), self.limit), loaded,
                                      round(time.monotonic() - started, 3))
        self.log.info("cluster prefetch (%s): %d of the %d recently used contexts this node owns and lacked "
                      "read from Redis in %.2f s", trigger, loaded, self.last_pass.wanted, self.last_pass.seconds)

    def _hand_over(self, context: Context, waking: zmq.Socket) -> bool:
        while not self.stopping.is_set():
            try:
                self.ready.put(context, timeout=0.5)
            except queue.Full:
                continue
            waking.send(b"")
            return True
        return False

