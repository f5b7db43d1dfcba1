"""Per-request figures the front-end keeps for the metrics endpoint: counts by op, priority
class, tenant, model and final code, and end-to-end (by op, class and model), time-to-first-token
and inter-token latency histograms.

Tenants label the counts (the authenticated identity once CURVE is on), but only the first
MAX_TENANT_LABELS of them: without authentication a client can name any tenant, and each new
label would be memory that grows with hostile input. Later ones count as "other". Models and
classes label them only by configured name (request_labels.py).

The front-end sees every request start and end, and every streamed chunk, so it measures them
as a client would. Time to first token and inter-token latency exist only for streamed
requests (a non-streamed reply has one moment, its end). A chunk carries the tokens of one
engine step, one per stream, so the gap between chunks is the inter-token latency.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import msgspec

from mcpd.histogram import Histogram, Snapshot, keyed

MAX_TENANT_LABELS = 256
OTHER_TENANTS = "other"


@dataclass(slots=True)
class Live:
    op: str
    cls: str
    tenant: str
    model: str
    started: float
    last_chunk: float | None = None


class MetricsSnapshot(msgspec.Struct, frozen=True):
    """What the front-end reports of them, as rows of their labels' values."""
    finished: list[tuple[str, str, str, str, str, int]] = []   # op, class, tenant, model, code; requests
    latency: list[tuple[str, str, str, Snapshot]] = []         # op, class, model
    ttft: list[tuple[str, Snapshot]] = []                      # by class
    itl: list[tuple[str, Snapshot]] = []
    inflight: dict[str, int] = {}                              # by class


class RequestMetrics:
    def __init__(self):
        self.live: dict[int, Live] = {}
        self.tenants: set[str] = set()
        self.finished: dict[tuple[str, str, str, str, str], int] = defaultdict(int)
        self.latency: dict[tuple[str, str, str], Histogram] = {}
        self.ttft: dict[str, Histogram] = {}
        self.itl: dict[str, Histogram] = {}

    def started(self, rid: int, op: str, cls: str, tenant: str, model: str) -> None:
        """cls, model: RequestLabels' labels, never names straight from the request."""
        self.live[rid] = Live(op, cls, self._tenant_label(tenant), model, time.monotonic())

    def _tenant_label(self, tenant: str) -> str:
        if tenant not in self.tenants and len(self.tenants) >= MAX_TENANT_LABELS:
            return OTHER_TENANTS
        self.tenants.add(tenant)
        return tenant

    def chunk_sent(self, rid: int) -> None:
        """A streamed chunk of `rid` went to its client."""
        live = self.live.get(rid)
        if live is None:
            return
        now = time.monotonic()
        if live.last_chunk is None:
            keyed(self.ttft, live.cls).observe(now - live.started)
        else:
            keyed(self.itl, live.cls).observe(now - live.last_chunk)
        live.last_chunk = now

    def ended(self, rid: int, code: str) -> None:
        live = self.live.pop(rid, None)
        if live is None:
            return
        self.finished[(live.op, live.cls, live.tenant, live.model, code)] += 1
        keyed(self.latency, (live.op, live.cls, live.model)).observe(time.monotonic() - live.started)

    def snapshot(self) -> MetricsSnapshot:
        inflight: dict[str, int] = defaultdict(int)
        for live in self.live.values():
            inflight[live.cls] += 1
        return MetricsSnapshot([(*key, n) for key, n in self.finished.items()],
                               [(*key, h.snapshot()) for key, h in self.latency.items()],
                               [(cls, h.snapshot()) for cls, h in self.ttft.items()],
                               [(cls, h.snapshot()) for cls, h in self.itl.items()], dict(inflight))

