"""The figures each child reports every supervisor.stats_interval_s (a Report event to the
supervisor; a worker's also go to the scheduler in its Stats message), as the supervisor keeps
them for `status` (status.py), the Prometheus endpoint (metrics.py) and `mcpctl`.

One typed value per process kind, declared here and encoded with messages.py's one encoding:
the child builds it from its figures (a figure not declared here is a TypeError in the child,
so none is lost on the way) and the supervisor decodes it once. A child that has not reported
yet has its kind's empty value; a figure a worker has not reported yet is None (status then
leaves it out, as it did before the first report). Every value is typed down to its leaves: a
component's figures are a struct declared beside it (here, when the process assembles them), and
a map is keyed by data (codes, classes, ops). Every struct travels as a map, so fields a reader
does not know are dropped at any depth: the events come from our own processes, but a newer
child's extra figure must not break an older reader.
"""
from __future__ import annotations

import msgspec

from mcpd.cluster.node_report import ClusterStats
from mcpd.daemon.frontend.latency import LatencySummary
from mcpd.daemon.frontend.outbox import OutboxStats
from mcpd.daemon.frontend.request_metrics import MetricsSnapshot
from mcpd.daemon.model_stats import ModelsStats
from mcpd.handlers.result_cache_stats import ResultCacheStats
from mcpd.histogram import Snapshot
from mcpd.memory.arena_stats import ArenaStats
from mcpd.memory.pool_stats import PoolStats, WorkerPoolStats


class SlowRequest(msgspec.Struct, frozen=True):
    rid: int
    tenant: str
    op: str
    model: str | None   # as the request names it; None: the default model
    age_ms: float


class IncomingStats(msgspec.Struct, frozen=True):
    """Client connections watched for unfinished messages, and those cut for holding too much
    (incoming.py), the client addresses held and those cut over the per-address cap
    (address_cap.py), and the socket backlogs found (socket_backlog.py)."""
    connections: int = 0
    cut: int = 0
    addresses: int = 0
    cut_over_address_cap: int = 0
    backlogs: int = 0


class HttpStats(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The OpenAI-compatible listener's (HttpListener.stats): its address as bound, whether it
    needs API keys, generations in flight, its answers by HTTP status; and its connections, left
    out until its connection table exists."""
    listen: str
    auth: bool
    inflight: int
    responses: dict[str, int]
    connections: int | None = None
    max_connections: int | None = None
    idle_shed: int | None = None
    refused: int | None = None
    accept_pauses: int


class RoutingStats(msgspec.Struct, frozen=True, kw_only=True):
    """Where the front-end sent requests in a cluster (Forwarding.stats): the nodes owning
    contexts, the peers connected, requests away at a peer now, where plain requests are offloaded
    (None: served here), and the requests forwarded, offloaded, received, and failed by cause."""
    owners: list[str]
    connected: list[str]
    away: int
    offloading_to: str | None
    forwarded: int
    offloaded: int
    received: int
    owner_unreachable: int
    owner_lost: int


class FrontendStats(msgspec.Struct, frozen=True, kw_only=True, tag="frontend"):
    inflight: int = 0               # requests admitted and not yet answered
    served: int = 0
    errors: dict[str, int] = {}     # by code
    latency: dict[str, LatencySummary] = {}   # by op
    draining: bool = False
    endpoints: list[str] = []       # as bound (a tcp port 0 resolved)
    metrics: MetricsSnapshot = msgspec.field(default_factory=MetricsSnapshot)   # counters and histograms
    backlog: OutboxStats = OutboxStats(0, 0, 0)
    incoming: IncomingStats = IncomingStats()
    http: HttpStats | None = None   # None: the listener is off
    slowest: list[SlowRequest] = []   # the requests in flight longest, the oldest first
    routing: RoutingStats | None = None   # None: [cluster] is off
    frozen_objects: int = 0         # objects start-up made, kept out of the garbage collector's passes (child.py)


class ClassQueue(msgspec.Struct, frozen=True):
    """A priority class's queue: its requests waiting, its cap (None: a reload removed the class),
    its batching window, and the recent queueing p99 that window steers by."""
    queued: int
    max_queue: int | None
    window_ms: float
    queue_p99_ms: float


class FastRungState(msgspec.Struct, frozen=True):
    active: list[str]   # the classes routed to fast versions now (fast_rung.py)
    entered: int        # times a class was


class EdgeShedState(msgspec.Struct, frozen=True):
    active: bool        # shed classes are refused at the front-end now (edge_shedding.py)
    entered: int


class JournalStats(msgspec.Struct, frozen=True):
    """The context journal's (Journal.stats), declared here so that every process decodes it
    without loading the journal."""
    enabled: bool
    fsync: str              # contexts.fsync: always, interval or never
    restored: int           # contexts restored from disk at start
    journal_bytes: int      # since its snapshot
    generation: int
    damaged_bytes: int
    state: str              # ok, unusable, or refusing changes until a snapshot is written
    fsync_seconds: Snapshot


class RedisContextStats(msgspec.Struct, frozen=True):
    """The cluster's Redis as this node's contexts use it (RedisContexts.stats)."""
    loaded: int    # contexts restored from Redis at first use
    folded: int    # context logs folded into a snapshot
    refused: int   # context ops refused because Redis could not take them
    behind: int    # contexts whose newest version Redis lacks (the journal alone has it)


class ContextsStats(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """ContextService.stats: the contexts held and their bytes; the host cache's share of them,
    left out with the cache off; the Redis figures, left out without a cluster."""
    contexts: int
    bytes: int
    cache_bytes: int | None = None
    cache_entries: int | None = None
    cache_tenant_share_bytes: int | None = None
    cache_largest_tenant_bytes: int | None = None   # the tenant holding most of it
    redis: RedisContextStats | None = None


class SchedulerStats(msgspec.Struct, frozen=True, kw_only=True, tag="scheduler"):
    queue_depth: int = 0
    dispatched: int = 0
    inflight: int = 0
    policy: str = ""
    degradation_level: int = 0
    fast_rung: FastRungState | None = None     # None: not reported yet
    edge_shed: EdgeShedState | None = None
    classes: dict[str, ClassQueue] = {}
    errors: dict[str, dict[str, int]] = {}   # by class, then code: the errors the scheduler decided
    contexts: ContextsStats | None = None   # None: not reported yet
    cache: ArenaStats | None = None   # the host cache's; None: it is off
    persistence: JournalStats | None = None   # None: not reported yet
    queue_time: dict[str, Snapshot] = {}   # by class
    workers: list[WorkerSlotStats] = []
    models: ModelsStats = ModelsStats()   # Scheduler.models_stats(): policies, versions, their workers
    cluster: ClusterStats | None = None   # ClusterNode.report(): this node, the live nodes it last saw, its prefetch; None when off
    frozen_objects: int = 0         # objects start-up made, kept out of the garbage collector's passes (child.py)


class WorkerStats(msgspec.Struct, frozen=True, kw_only=True, tag="worker"):
    """The engine's figures (Engine.stats, documented there) and the worker's own; None: not
    reported yet."""
    index: int | None = None
    pid: int | None = None
    device: str | None = None
    model: str | None = None
    served_model: str | None = None   # the model table's name (config/models.py), and the version it serves
    version: str | None = None
    dtype: str | None = None
    quantization: str | None = None   # "none" or "int8"
    kernels: str | None = None
    threads: int | None = None
    max_model_len: int | None = None
    running: int | None = None
    waiting: int | None = None
    preemptions: int | None = None
    steps: int | None = None
    kv_blocks_total: int | None = None
    kv_blocks_used: int | None = None
    kv_block_size: int | None = None
    kv_waste_frac: float | None = None
    cached_blocks: int | None = None
    pool: WorkerPoolStats | None = None
    tokens_prefilled: int | None = None
    tokens_generated: int | None = None
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None   # prompt tokens served from device KV blocks
    host_kv_loaded: int | None = None
    host_kv_saved: int | None = None
    batch_size: Snapshot | None = None   # sequences per step
    batches: int | None = None      # a handler worker's: predicts run, the rows they ran, and the
    rows: int | None = None         #   share of their padded inputs' elements that was padding
    mean_batch_rows: float | None = None
    padding_ratio: float | None = None
    result_cache: ResultCacheStats | None = None   # a handler worker's; None: no cache

    def reported(self, names: tuple[str, ...]) -> dict:
        """{name: value} of those of `names` that are figures of a worker and were reported."""
        return {name: getattr(self, name) for name in names if getattr(self, name, None) is not None}


class WorkerSlotStats(WorkerStats, tag=False):
    """A worker as the scheduler sees it (router.py's WorkerSlot): what it last said of itself (its
    Hello, then its stats) and, beside those figures in the same map, whether it takes requests
    and the requests and tokens it holds."""
    ready: bool = False
    inflight: int = 0
    outstanding_tokens: int = 0


class KeeperStats(msgspec.Struct, frozen=True, kw_only=True, tag="keeper"):
    """A device pool's figures (PoolSegment.stats: sizes, waste, fragmentation, regions)."""
    device: str | None = None
    path: str | None = None
    pool: PoolStats | None = None   # None: not reported yet


KINDS = {"frontend": FrontendStats, "scheduler": SchedulerStats, "worker": WorkerStats, "keeper": KeeperStats}
ANY = FrontendStats | SchedulerStats | WorkerStats | KeeperStats


def empty(role: str):
    return KINDS[role]()
