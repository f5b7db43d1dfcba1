"""Where everything lives in a host cache segment (ShmArena): the header, the slot table and the
page table, each a set of columns, then the pages.

    header | slot columns (one row per entry slot) | page columns (one row per page) | pages

Columns rather than one record per slot: the arena's lookups scan a column with numpy (the
8-byte key tags, the 1-byte states), and a contiguous column is read at memory speed while a
field strided through 80-byte records drags every record's cache line along: with 131,072
slots (256 MiB at one slot per 2 KiB) a tag scan reads 1 MiB, where records would drag 10 MiB.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAGIC = 0x326E72616470636D   # "mcpdarn2"
HEADER = np.dtype([("magic", "<u8"), ("page_bytes", "<u8"), ("num_pages", "<u8"), ("num_slots", "<u8"),
                   ("dirty", "<u8"), ("half_life", "<f8"), ("clock", "<u8"), ("hits", "<u8"), ("misses", "<u8"),
                   ("evictions", "<u8"), ("inserts", "<u8"), ("refused", "<u8"), ("moved", "<u8")])
SLOT_COLUMNS = (("state", "u1"), ("kind", "u1"), ("pinned", "u1"),
                ("klass", "u1"),      # 0: a chain of whole pages; k >= 1: one block of size class k
                ("block", "<u2"),     # the block's index in its page (size classes only)
                ("pid", "<i4"),       # the writer, while WRITING
                ("first", "<u4"),     # the first page of the chain, or the block's page
                ("npages", "<u4"), ("tag", "<u8"), ("nbytes", "<u8"), ("last", "<u8"), ("crf", "<f8"),
                ("key", "V32"))
PAGE_COLUMNS = (("page_kind", "u1"),  # FREE, CHAIN, or CHAIN + k: a page of class k's blocks
                ("blocks_used", "<u2"), ("next", "<u4"),
                ("bitmap", ("u1", (32,))))   # which of the page's (at most 256) blocks are taken
SLOT_BYTES = sum(np.dtype(t).itemsize for _, t in SLOT_COLUMNS)
PAGE_META_BYTES = sum(np.dtype(t).itemsize for _, t in PAGE_COLUMNS)
ALIGN = 4096
COLUMN_ALIGN = 64
BYTES_PER_SLOT = 2048   # slots a segment gets: one per this many bytes of it
MIN_SLOTS = 64


@dataclass(frozen=True)
class Layout:
    num_slots: int
    num_pages: int
    page_bytes: int

    def offsets(self) -> tuple[dict[str, int], int, int]:
        """Each column's offset, where the pages begin, and the segment's size."""
        at, where = aligned(HEADER.itemsize, COLUMN_ALIGN), {}
        for columns, rows in ((SLOT_COLUMNS, self.num_slots), (PAGE_COLUMNS, self.num_pages)):
            for name, kind in columns:
                where[name] = at
                at = aligned(at + rows * np.dtype(kind).itemsize, COLUMN_ALIGN)
        pages_at = aligned(at, ALIGN)
        return where, pages_at, pages_at + self.num_pages * self.page_bytes

    @property
    def size(self) -> int:
        return self.offsets()[2]

    @classmethod
    def fitting(cls, nbytes: int, page_bytes: int, num_slots: int | None = None) -> "Layout":
        """The most pages that fit nbytes beside the slot table (one slot per BYTES_PER_SLOT of
        nbytes unless given)."""
        slots = num_slots or max(MIN_SLOTS, nbytes // BYTES_PER_SLOT)
        pages = max(0, (nbytes - cls(slots, 0, page_bytes).size) // (page_bytes + PAGE_META_BYTES))
        while pages and cls(slots, pages, page_bytes).size > nbytes:   # the estimate ignored alignment
            pages -= 1
        while cls(slots, pages + 1, page_bytes).size <= nbytes:
            pages += 1
        return cls(slots, pages, page_bytes)


def columns(buffer, layout: Layout) -> dict[str, np.ndarray]:
    """Every column as a numpy view of the segment."""
    where, _, _ = layout.offsets()
    views = {}
    for specs, rows in ((SLOT_COLUMNS, layout.num_slots), (PAGE_COLUMNS, layout.num_pages)):
        for name, kind in specs:
            views[name] = np.frombuffer(buffer, kind, rows, where[name])
    return views


def aligned(n: int, to: int) -> int:
    return -(-n // to) * to
