"""The one way a node connects to the cluster's Redis."""
from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from mcpd.config import ClusterConfig


def connect(config: ClusterConfig) -> redis.Redis:
    # One retry at once: the first call after Redis restarts meets a pooled connection it closed;
    # the scripts make a write sent twice count once. Thread-safe: each thread takes its own
    # connection from the pool.
    return redis.Redis.from_url(config.redis, socket_timeout=config.timeout_s,
                                socket_connect_timeout=config.timeout_s, retry=Retry(NoBackoff(), 1))
