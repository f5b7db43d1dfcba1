"""A device pool's figures as its keeper and its workers report them (PoolSegment.stats,
Engine.stats), apart from the pool so that every process decodes them without loading numpy."""
from __future__ import annotations

import msgspec


class PoolRegion(msgspec.Struct, frozen=True):
    kind: str        # weights, kv, or unknown
    owner: int       # the worker's index
    pid: int
    pid_alive: bool
    offset: int
    bytes: int


class PoolStats(msgspec.Struct, frozen=True):
    total_bytes: int
    in_use_bytes: int
    requested_bytes: int
    free_bytes: int
    largest_free_block: int
    internal_waste_frac: float       # bytes handed out beyond what was asked
    external_fragmentation: float    # 1 - largest free block / free bytes
    regions: list[PoolRegion]        # by offset


class WorkerPoolStats(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A worker's pool: the device's shared one (regions aside: the keeper reports them), or its
    own private one; the figures of the other kind are left out."""
    total_bytes: int
    in_use_bytes: int                # a private pool's KV region counts as in use (and requested)
    requested_bytes: int
    free_bytes: int
    largest_free_block: int
    live_allocations: int | None = None    # a private pool's
    internal_waste_frac: float
    external_fragmentation: float
    shared: bool
    kv_reserved_bytes: int | None = None   # a private pool's
    kv_region_bytes: int | None = None     # a shared pool's, and the next two
    kv_blocks_adopted: int | None = None
    weights_from_pool: bool | None = None
