"""The figures each child reports in its periodic "stats" event, as the supervisor keeps them for
`status` (status.py), the Prometheus endpoint (metrics.py) and through `status`, `mcpctl`.

One typed value per process kind, declared here, instead of each reader guessing keys and
defaults. A child that has not reported yet has its kind's empty value; a figure a worker has
not reported yet is None (status then leaves it out, as it did before the first report).
Fields the reader does not know are dropped: the events come from our own processes, but a
newer child's extra figure must not break an older reader.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FrontendStats:
    inflight: int = 0               # requests admitted and not yet answered
    served: int = 0
    errors: dict = field(default_factory=dict)       # {code: count}
    latency: dict = field(default_factory=dict)      # {op: {count, p50_ms, p99_ms}} (latency.py)
    draining: bool = False
    endpoints: list = field(default_factory=list)    # as bound (a tcp port 0 resolved)
    metrics: dict = field(default_factory=dict)      # RequestMetrics.snapshot(): counters and histograms
    backlog: dict = field(default_factory=dict)      # Outbox.stats()
    incoming: dict = field(default_factory=dict)     # IncomingBytes.stats()


@dataclass(frozen=True)
class SchedulerStats:
    queue_depth: int = 0
    dispatched: int = 0
    inflight: int = 0
    policy: str = ""
    degradation_level: int = 0
    classes: dict = field(default_factory=dict)      # {class: {queued, window_ms, queue_p99_ms}}
    errors: dict = field(default_factory=dict)       # {class: {code: count}}, the errors the scheduler decided
    contexts: dict = field(default_factory=dict)     # ContextService.stats(): contexts, bytes
    cache: dict = field(default_factory=dict)        # the host cache arena's figures; empty when it is off
    persistence: dict = field(default_factory=dict)  # the journal's
    queue_time: dict | None = None                   # a Histogram snapshot
    workers: list = field(default_factory=list)


@dataclass(frozen=True)
class WorkerStats:
    """The engine's figures (Engine.stats) and the worker's own; None: not reported yet."""
    device: str | None = None
    model: str | None = None
    dtype: str | None = None
    kernels: str | None = None
    running: int | None = None
    waiting: int | None = None
    preemptions: int | None = None
    kv_blocks_total: int | None = None
    kv_blocks_used: int | None = None
    kv_waste_frac: float | None = None
    pool: dict | None = None
    tokens_prefilled: int | None = None
    tokens_generated: int | None = None
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None   # prompt tokens served from device KV blocks
    host_kv_loaded: int | None = None
    host_kv_saved: int | None = None
    batch_size: dict | None = None                   # a Histogram snapshot of sequences per step

    def reported(self, names: tuple[str, ...]) -> dict:
        """{name: value} of those of `names` that are figures of a worker and were reported."""
        return {name: getattr(self, name) for name in names if getattr(self, name, None) is not None}


@dataclass(frozen=True)
class KeeperStats:
    """A device pool's figures (PoolSegment.stats: sizes, waste, fragmentation, regions)."""
    device: str | None = None
    path: str | None = None
    pool: dict = field(default_factory=dict)


KINDS = {"frontend": FrontendStats, "scheduler": SchedulerStats, "worker": WorkerStats, "keeper": KeeperStats}


def of(role: str, event: dict):
    """The typed stats of a child of `role` from its event (unknown fields dropped)."""
    kind = KINDS[role]
    return kind(**{f.name: event[f.name] for f in dataclasses.fields(kind) if f.name in event})


def empty(role: str):
    return KINDS[role]()
