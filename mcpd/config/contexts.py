"""Where contexts live: [contexts] limits, the host [cache], the [persistence] journal and the
Redis [cluster]."""
from __future__ import annotations

import socket
from dataclasses import dataclass

from mcpd.cluster import redis_url
from mcpd.config.listeners import listen_host
from mcpd.config_bounds import HOUR_S, MAX_BYTES, MAX_REQUESTS, bounded
from mcpd.config_error import ConfigError

MAX_CONTEXT_COUNT = 1 << 24   # contexts: each is a Python object in the scheduler and an entry in the cache
MAX_FIELDS = 1 << 20


@dataclass(frozen=True)
class ContextsConfig:
    max_per_owner: int = bounded(1024, 1, MAX_CONTEXT_COUNT)    # contexts one tenant may hold
    max_contexts: int = bounded(65536, 1, MAX_CONTEXT_COUNT)    # contexts of all tenants together
    max_context_bytes: int = bounded(1 << 30, 1, MAX_BYTES)     # token ids + fields of one context
    max_field_bytes: int = bounded(256 << 20, 1, MAX_BYTES)     # one field, decoded
    max_owner_bytes: int = bounded(2 << 30, 1, MAX_BYTES)       # all contexts of one tenant together
    max_total_bytes: int = bounded(4 << 30, 1, MAX_BYTES)       # all contexts together (in the scheduler's memory)
    max_fields: int = bounded(4096, 1, MAX_FIELDS)              # fields of one context besides tokens

    def check(self) -> None:
        pass   # its ranges are its fields' bounds


MAX_CACHE_BYTES = 1 << 42   # its pages and entry slots are numbered in 32 bits (memory/shm_layout.py): 2^31 at most


@dataclass(frozen=True)
class CacheConfig:
    enabled: bool = True              # the host shared-memory cache of contexts and evicted KV blocks
    bytes: int = bounded(256 << 20, 1, MAX_CACHE_BYTES)   # its segment in /dev/shm (tmpfs backs only the pages written)
    # allocation unit of entries over half a page; smaller ones take blocks
    page_bytes: int = bounded(16 << 10, 4096, 1 << 30)
    # of the cache's bytes and entries one tenant's contexts may occupy
    max_owner_fraction: float = bounded(0.5, 0, 1, low_open=True)

    def check(self) -> None:
        if self.page_bytes & (self.page_bytes - 1):
            raise ConfigError(f"cache.page_bytes = {self.page_bytes}: must be a power of two >= 4096")
        if self.bytes < 64 * self.page_bytes:
            raise ConfigError(f"cache.bytes = {self.bytes}: must hold at least 64 pages of cache.page_bytes")


MAX_FSYNC_INTERVAL_S = HOUR_S


@dataclass(frozen=True)
class PersistenceConfig:
    enabled: bool = True               # journal committed contexts to <state_dir>/contexts
    fsync: str = "always"              # always, interval or never (see etc/mcpd.toml for the trade-off)
    # fsync = "interval": the most a power cut can lose (past hours the fsync thread's wait overflows, and it dies)
    fsync_interval_s: float = bounded(1.0, 0, MAX_FSYNC_INTERVAL_S, low_open=True)
    compact_after_bytes: int = bounded(256 << 20, 1, MAX_BYTES)   # journal size past which it is folded into a snapshot

    def check(self) -> None:
        if self.fsync not in ("always", "interval", "never"):
            raise ConfigError(f"persistence.fsync = {self.fsync!r}: use always, interval or never")


MAX_NODE_ID_CHARS = 64
MAX_NODE_TTL_S = HOUR_S   # past it Redis refuses the heartbeat's expiry: the node never joins
MIN_NODE_WEIGHT, MAX_NODE_WEIGHT = 0.001, 1000.0   # bounded: the live nodes' sum never overflows
MAX_RECENT_CONTEXTS = 1 << 20   # the recency index is read whole at a takeover: about 140 MB of Redis at most


@dataclass(frozen=True)
class ClusterConfig:
    """Several nodes sharing contexts through Redis (docs/CLUSTER.md); off while `redis` is ""."""
    redis: str = ""                     # one server's URL, redis+cluster://, redis+sentinel:// (CLUSTER.md); "" = off
    node_id: str = ""                   # this node's name among the others; "" = the host name
    advertise_tcp: str = ""             # the ZeroMQ endpoint other nodes and clients reach this node at
    advertise_http: str = ""            # its HTTP listener's URL, likewise
    timeout_s: float = bounded(1.0, 0, 60, low_open=True)   # a Redis call still unanswered after this refuses the change
    # a context's commit log in Redis past which it is folded into a snapshot
    compact_after_bytes: int = bounded(64 << 10, 1, MAX_BYTES)
    # this node's capacity: its share of contexts is its weight over the sum
    weight: float = bounded(1.0, MIN_NODE_WEIGHT, MAX_NODE_WEIGHT)
    # how often the node tells Redis it is alive, with its load (below node_ttl_s)
    heartbeat_s: float = bounded(1.0, 0, MAX_NODE_TTL_S, low_open=True)
    node_ttl_s: float = bounded(3.0, 0, MAX_NODE_TTL_S, low_open=True)   # a node silent this long counts as gone
    when_redis_down: str = "refuse"     # refuse context changes (retryably), or go on with the "journal" alone
    # at start or takeover, load this many recently used contexts it owns; 0 = off
    prefetch_contexts: int = bounded(64, 0, MAX_RECENT_CONTEXTS)
    # the cluster's recency index keeps this many contexts (size it >= prefetch x nodes)
    recent_contexts: int = bounded(16384, 0, MAX_RECENT_CONTEXTS)
    forward: bool = True                # send a request for a context another node owns to that node
    # queued requests over which a plain request goes to a less loaded node; 0 = off
    offload_queued: int = bounded(64, 0, MAX_REQUESTS)
    peer_tenants: tuple[str, ...] = ()  # with CURVE on: the key names of the other nodes, trusted to forward for any tenant

    def check(self) -> None:
        if self.redis:
            try:
                redis_url.parse(self.redis)
            except ValueError as e:
                raise ConfigError(f"cluster.redis = {self.redis!r}: {e}; use redis://host:port/db, rediss://..., "
                                  "unix://path, redis+cluster://host:port,host:port or "
                                  "redis+sentinel://host:port,host:port/service") from None
        if len(self.node_id) > MAX_NODE_ID_CHARS or not self.node_id.isprintable():
            raise ConfigError(f"cluster.node_id = {self.node_id!r}: at most {MAX_NODE_ID_CHARS} printable characters")
        if self.advertise_tcp and not self.advertise_tcp.startswith("tcp://"):
            raise ConfigError(f"cluster.advertise_tcp = {self.advertise_tcp!r}: must start with tcp://")
        if self.advertise_tcp:
            listen_host("cluster.advertise_tcp", self.advertise_tcp, "tcp://10.0.0.5:7070")
        if self.advertise_http and not self.advertise_http.startswith(("http://", "https://")):
            raise ConfigError(f"cluster.advertise_http = {self.advertise_http!r}: must start with http:// or https://")
        if self.when_redis_down not in ("refuse", "journal"):
            raise ConfigError(f"cluster.when_redis_down = {self.when_redis_down!r}: use refuse or journal")
        if self.prefetch_contexts > self.recent_contexts:
            raise ConfigError(f"cluster.prefetch_contexts = {self.prefetch_contexts}: must be <= recent_contexts = "
                              f"{self.recent_contexts}")
        if self.heartbeat_s >= self.node_ttl_s:
            raise ConfigError(f"cluster.heartbeat_s = {self.heartbeat_s}: must be below node_ttl_s = {self.node_ttl_s}")

    @property
    def enabled(self) -> bool:
        return bool(self.redis)

    @property
    def node_name(self) -> str:
        return self.node_id or socket.gethostname()
