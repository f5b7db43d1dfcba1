"""What the host cache holds of one context: a snapshot at some version and the delta entries
written since, one per later version (commit.py). ContextCache keeps one per context in memory (load()
rebuilds them from the arena) and asks it when the next commit should be a snapshot instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mcpd.contexts.record import Record

# A fresh snapshot once the deltas since the last would weigh more than this fraction of the
# context: the arena then holds at most 1.5x the context for it (plus one delta), and a snapshot
# costs at most twice the delta bytes it replaces, so the cache writes at most ~3x what the
# commits changed.
SNAPSHOT_FRACTION = 0.5
# ... or once this many deltas follow it: a restart replays every one, so a long chain of a big
# context's deltas delays the start, while a snapshot every MAX_DELTAS commits adds little to each
# on average.
MAX_DELTAS = 16


@dataclass
class CacheChain:
    snapshot_version: int
    snapshot_footprint: int   # what its entries occupy of the arena (ShmArena.footprint)
    deltas: dict[int, tuple[int, int]] = field(default_factory=dict)   # version -> (weight, footprint)

    def wants_snapshot(self, weight: int, context_bytes: int) -> bool:
        """Whether the commit of a delta of this weight should write a snapshot instead. The
        context's size is what it holds, or what its snapshot took if more: a context of many
        scalars holds 8 bytes a field but its snapshot also names each, and measured against the
        8 bytes every delta would look heavy and every commit would write a whole snapshot."""
        size = max(context_bytes, self.snapshot_footprint)
        return len(self.deltas) >= MAX_DELTAS or sum(w for w, _ in self.deltas.values()) + weight > SNAPSHOT_FRACTION * size

    @property
    def footprint(self) -> int:
        return self.snapshot_footprint + sum(f for _, f in self.deltas.values())

    @property
    def entries(self) -> int:
        return 1 + len(self.deltas)


def weight(record: Record, stored: int) -> int:
    """What a commit's entry counts toward the next snapshot: its stored bytes or, when more,
    the decoded bytes of the new values it brings (set and append payloads). A snapshot will have
    to hold those: counting them decoded makes a big but compressible value (zeros) snapshot at
    the commit that brings it, so a context the cache cannot hold whole is refused then, not at a
    later small commit that happens to compact."""
    brought = sum(entry["meta"]["nbytes"] for entry in record.meta["changes"]
                  if entry["kind"] in ("set", "append") and entry["meta"].get("type") != "scalar")
    return max(stored, brought)
