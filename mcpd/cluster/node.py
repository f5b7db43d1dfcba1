"""This node's part in the cluster beside its contexts in Redis: the heartbeat (membership and
the recency index), the prefetch at start and takeover, and the listener that notes which contexts
this node used. The scheduler's process holds one when [cluster] is on and calls it from its loop:
report() at each stats interval, adopt_prefetched() when `wakeup` is readable, close() at a stop.
"""
from __future__ import annotations

import logging

import zmq

from mcpd.cluster.heartbeat import Heartbeat
from mcpd.cluster.prefetch import Prefetch
from mcpd.cluster.recency import RecentContexts
from mcpd.cluster.node_report import ClusterStats, PrefetchStats
from mcpd.cluster.redis_client import connect
from mcpd.cluster.used_contexts import UsedContexts
from mcpd.config import ClusterConfig
from mcpd.contexts.persistence import Persistence
from mcpd.protocol.codes import MCPDError


class ClusterNode:
    def __init__(self, config: ClusterConfig, persistence: Persistence, zmq_context: zmq.Context,
                 log: logging.Logger, curve_key: str = ""):
        client = connect(config)
        recent = RecentContexts(client, config.recent_contexts)
        self.store, self.log = persistence.store, log
        self.used = UsedContexts()
        self.store.listeners.append(self.used)   # last: it hears only what every other listener took
        self.prefetch = Prefetch(zmq_context, recent, persistence.shared, config.node_name, config.prefetch_contexts,
                                 self.store.contexts.__contains__, config.heartbeat_s, log)
        self.wakeup = self.prefetch.wakeup
        self.prefetched = 0   # contexts adopted from a prefetch
        self.heartbeat = Heartbeat(config, client, recent, self.prefetch.observe, log, curve_key)
        self.prefetch.start()
        self.heartbeat.start()

    def adopt_prefetched(self) -> None:
        """Hold the context the prefetch read, unless a request brought it in first. A refusal (the
        host cache or the tenant's share is full) costs the prefetch, never a request."""
        context = self.prefetch.take()
        if context is None:
            return
        try:
            self.prefetched += self.store.adopt(context)
        except MCPDError as e:
            self.log.warning("cluster prefetch: context %s/%s not kept (%s)", context.owner, context.id, e.message)

    def report(self, load: dict) -> ClusterStats:
        """Hand the heartbeat this node's load and the contexts used since; what `status` shows."""
        self.heartbeat.update(load, *self.used.take())
        return ClusterStats(**self.heartbeat.stats(), owners=self.prefetch.owners,
                            prefetch=PrefetchStats(self.prefetched, self.prefetch.last_pass))

    def close(self) -> None:
        self.heartbeat.close()
        self.prefetch.close()
