"""Where contexts live: [contexts] limits, the host [cache], the [persistence] journal and the
Redis [cluster]."""
from __future__ import annotations

import socket
from dataclasses import dataclass

from mcpd.cluster import redis_url
from mcpd.config.listeners import listen_host
from mcpd.config_error import ConfigError


@dataclass(frozen=True)
class ContextsConfig:
    max_per_owner: int = 1024           # contexts one tenant may hold
    max_contexts: int = 65536           # contexts of all tenants together
    max_context_bytes: int = 1 << 30    # token ids + fields of one context
    max_field_bytes: int = 256 << 20    # one field, decoded
    max_owner_bytes: int = 2 << 30      # all contexts of one tenant together
    max_total_bytes: int = 4 << 30      # all contexts together (they live in the scheduler's memory)
    max_fields: int = 4096              # fields of one context besides tokens

    def check(self) -> None:
        if min(self.max_per_owner, self.max_contexts, self.max_context_bytes, self.max_field_bytes,
               self.max_owner_bytes, self.max_total_bytes, self.max_fields) < 1:
            raise ConfigError("every contexts.max_* must be >= 1")


@dataclass(frozen=True)
class CacheConfig:
    enabled: bool = True              # the host shared-memory cache of contexts and evicted KV blocks
    bytes: int = 256 << 20            # its segment in /dev/shm (tmpfs backs only the pages written)
    page_bytes: int = 16 << 10        # allocation unit of entries over half a page; smaller ones take blocks
    max_owner_fraction: float = 0.5   # of the cache's bytes and entries one tenant's contexts may occupy

    def check(self) -> None:
        if self.page_bytes < 4096 or self.page_bytes & (self.page_bytes - 1):
            raise ConfigError(f"cache.page_bytes = {self.page_bytes}: must be a power of two >= 4096")
        if self.bytes < 64 * self.page_bytes:
            raise ConfigError(f"cache.bytes = {self.bytes}: must hold at least 64 pages of cache.page_bytes")
        if not 0 < self.max_owner_fraction <= 1:
            raise ConfigError(f"cache.max_owner_fraction = {self.max_owner_fraction}: must be in (0, 1]")


MAX_FSYNC_INTERVAL_S = 3600.0


@dataclass(frozen=True)
class PersistenceConfig:
    enabled: bool = True               # journal committed contexts to <state_dir>/contexts
    fsync: str = "always"              # always, interval or never (see etc/mcpd.toml for the trade-off)
    fsync_interval_s: float = 1.0      # fsync = "interval": the most a power cut can lose
    compact_after_bytes: int = 256 << 20   # journal size past which it is folded into a snapshot

    def check(self) -> None:
        if self.fsync not in ("always", "interval", "never"):
            raise ConfigError(f"persistence.fsync = {self.fsync!r}: use always, interval or never")
        if self.fsync_interval_s <= 0 or self.compact_after_bytes < 1:
            raise ConfigError("persistence.fsync_interval_s and compact_after_bytes must be positive")
        if self.fsync_interval_s > MAX_FSYNC_INTERVAL_S:   # the fsync thread's wait overflows, and it dies
            raise ConfigError(f"persistence.fsync_interval_s = {self.fsync_interval_s}: at most {MAX_FSYNC_INTERVAL_S:g}")


MAX_NODE_ID_CHARS = 64
MAX_NODE_TTL_S = 3600.0
MAX_RECENT_CONTEXTS = 1 << 20   # the recency index is read whole at a takeover: about 140 MB of Redis at most


@dataclass(frozen=True)
class ClusterConfig:
    """Several nodes sharing contexts through Redis (docs/CLUSTER.md); off while `redis` is ""."""
    redis: str = ""                     # one server's URL, redis+cluster://, redis+sentinel:// (CLUSTER.md); "" = off
    node_id: str = ""                   # this node's name among the others; "" = the host name
    advertise_tcp: str = ""             # the ZeroMQ endpoint other nodes and clients reach this node at
    advertise_http: str = ""            # its HTTP listener's URL, likewise
    timeout_s: float = 1.0              # a Redis call still unanswered after this refuses the change
    compact_after_bytes: int = 64 << 10  # a context's commit log in Redis past which it is folded into a snapshot
    weight: float = 1.0                 # this node's capacity: its share of contexts is its weight over the sum
    heartbeat_s: float = 1.0            # how often the node tells Redis it is alive, with its load
    node_ttl_s: float = 3.0             # a node silent this long counts as gone
    when_redis_down: str = "refuse"     # refuse context changes (retryably), or go on with the "journal" alone
    prefetch_contexts: int = 64         # at start or takeover, load this many recently used contexts it owns; 0 = off
    recent_contexts: int = 16384        # the cluster's recency index keeps this many contexts (size it >= prefetch x nodes)
    forward: bool = True                # send a request for a context another node owns to that node
    offload_queued: int = 64            # queued requests over which a plain request goes to a less loaded node; 0 = off
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
        if not 0 < self.timeout_s <= 60 or self.compact_after_bytes < 1:
            raise ConfigError("cluster.timeout_s must be in (0, 60] and cluster.compact_after_bytes >= 1")
        if self.when_redis_down not in ("refuse", "journal"):
            raise ConfigError(f"cluster.when_redis_down = {self.when_redis_down!r}: use refuse or journal")
        if not 0 <= self.prefetch_contexts <= self.recent_contexts <= MAX_RECENT_CONTEXTS:
            raise ConfigError(f"cluster.prefetch_contexts = {self.prefetch_contexts} and recent_contexts = "
                              f"{self.recent_contexts}: need 0 <= prefetch <= recent <= {MAX_RECENT_CONTEXTS}")
        if self.offload_queued < 0:
            raise ConfigError(f"cluster.offload_queued = {self.offload_queued}: must be >= 0 (0 = off)")
        if self.weight <= 0 or not 0 < self.heartbeat_s < self.node_ttl_s:
            raise ConfigError(f"cluster.weight = {self.weight} must be > 0 and cluster.heartbeat_s = "
                              f"{self.heartbeat_s} in (0, node_ttl_s = {self.node_ttl_s})")
        if self.node_ttl_s > MAX_NODE_TTL_S:   # Redis refuses the heartbeat's expiry: the node never joins
            raise ConfigError(f"cluster.node_ttl_s = {self.node_ttl_s}: at most {MAX_NODE_TTL_S:g}")

    @property
    def enabled(self) -> bool:
        return bool(self.redis)

    @property
    def node_name(self) -> str:
        return self.node_id or socket.gethostname()
