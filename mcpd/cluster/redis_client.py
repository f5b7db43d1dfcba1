"""The one way a node connects to the cluster's Redis: one server, a Redis Cluster or a
Sentinel-watched primary, as cluster.redis says (redis_url.py). Every context's keys share a
hash tag, and so do the membership keys, so the scripts run on Cluster as on one server."""
from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry
from redis.sentinel import Sentinel

from mcpd.cluster import redis_url
from mcpd.config import ClusterConfig

# What a call raises when Redis cannot answer it: RedisCluster raises the second, no RedisError,
# when none of the cluster's nodes can be reached.
REDIS_ERRORS = (redis.RedisError, RedisClusterException)


def connect(config: ClusterConfig) -> redis.Redis | RedisCluster:
    # One retry at once: the first call after Redis restarts meets a pooled connection it closed;
    # the scripts make a write sent twice count once. Thread-safe: each thread takes its own
    # connection from the pool.
    timeouts = {"socket_timeout": config.timeout_s, "socket_connect_timeout": config.timeout_s}
    where = redis_url.parse(config.redis)
    if where.kind == "cluster":
        return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in where.hosts], ssl=where.tls,
                            username=where.username, password=where.password, retry=Retry(NoBackoff(), 1), **timeouts)
    if where.kind == "sentinel":
        return Sentinel(list(where.hosts), **timeouts).master_for(
            where.service, db=where.db, username=where.username, password=where.password,
            retry=Retry(NoBackoff(), 1), **timeouts)
    return redis.Redis.from_url(config.redis, retry=Retry(NoBackoff(), 1), **timeouts)
