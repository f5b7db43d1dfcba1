"""A node's heartbeat report as the other nodes read it from Redis (membership.py), and the view of
the cluster the scheduler reports for `status` (node.py). Redis holds what anyone who can write
there wrote: a report is decoded into NodeReport where it is read, and one that does not decode is
left out. Unknown fields are dropped, so a newer node may add some."""
from __future__ import annotations

import msgspec


class NodeReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a node's heartbeat says (heartbeat.py): its endpoints, weight and CURVE key ("": off),
    its load once its scheduler reported one (None before), the models it serves, and the age of
    the beat, stamped on reading (None: unreadable)."""
    tcp: str = ""
    http: str = ""
    weight: float = 0.0
    curve_key: str = ""
    queued: int | None = None
    inflight: int | None = None
    free_kv_blocks: int | None = None
    models: list[str] = []
    age_ms: int | None = None


class GoneNode(NodeReport, frozen=True, kw_only=True):
    """A node seen to leave: its last report, when (time.time()), and how long ago."""
    gone_at: float
    gone_s: float = 0.0


class PrefetchPass(msgspec.Struct, frozen=True):
    """The last prefetch pass (prefetch.py): why, the recent contexts this node owns, those it
    lacked (up to the limit), those it loaded, and how long it took."""
    trigger: str
    owned: int
    wanted: int
    loaded: int
    seconds: float


class PrefetchStats(msgspec.Struct, frozen=True):
    prefetched: int                   # contexts adopted from a prefetch
    last_pass: PrefetchPass | None    # None: none yet


class ClusterStats(msgspec.Struct, frozen=True, kw_only=True):
    """This node, whether its heartbeat reaches Redis ("ok", or why not), the live nodes it last saw
    and those seen to leave, by id; the heartbeat's round trip (None: none yet), the recently used
    contexts indexed, the indexed contexts each live node owns, and its prefetch."""
    node: str
    heartbeat: str
    nodes: dict[str, NodeReport]
    gone: dict[str, GoneNode]
    redis_rtt_ms: float | None
    recent_indexed: int
    owners: dict[str, int]
    prefetch: PrefetchStats
