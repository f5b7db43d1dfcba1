"""A key-value arena in one host shared-memory segment, shared by every mcpd process.

The scheduler keeps committed contexts in it and every worker KV blocks (keyed by their chain
hash), so any process can find what another wrote, and a crash of the writer loses nothing it
published. Its state lives in the segment itself, never in a process (shm_layout.py).

Allocator: two ways to hold an entry, so that small entries stay small.
- An entry over half a page takes a chain of whole pages (cache.page_bytes) linked through
  `next`: it wastes under one page, and any free page serves any such entry. Chains take free
  pages lowest-address first, so an entry's pages are mostly consecutive and copied as a few
  long runs. (buddy.py's free lists live in Python objects, which other processes cannot see.)
- A smaller entry takes one block of a size class (arena_blocks.py): powers of two up to half a
  page, a page cut into one class's blocks. A 200-byte context takes 256 bytes, not a 16 KiB
  page. Block pages are taken from the top of the page range, away from the chains.
Blocks freed here and there leave pages each holding a few: when whole pages run short, the
live blocks of each class are packed into as few pages as they need (`_defragment`) before
anything is evicted, so dropped contexts cannot keep the cache's pages.

`footprint(n)` is what an entry of n bytes occupies, its block or pages and its slot: what the
context cache charges tenants.

Index: the slot table, one slot per entry (one slot per 2 KiB of segment: 131,072 for 256 MiB,
room for 65,536 contexts and their delta entries beside the KV blocks). A slot holds an
entry's kind, 32-byte key (BLAKE2b digests: KV chain hashes, context ids), size, place, and its
eviction statistics; lookups match the key's first 8 bytes over the tag column with numpy,
then compare the full key.

Eviction: LRFU (Lee et al., 2001), which spans recency and frequency with one parameter. Each
entry carries a combined recency-frequency value, crf = sum over its past references of
2^(-age / half_life), age counting cache accesses (puts and hits) since that reference: a one-off
entry decays from 1, one hit k times lately is worth about k. The lowest crf goes first. half_life defaults to a quarter of
the page count, so a reference's weight halves while about a quarter of the cache turns over:
a block reused every turn of a live chat outlives a burst of one-off prompts, while a chat that
went quiet fades out. Pinned entries (contexts: committed state) are never evicted; a put that
cannot fit after evicting everything else raises ArenaFull, having evicted nothing.

Crash safety. Metadata changes under a FileLock (released by the kernel if its holder dies),
which sets `dirty` first and clears it last; whoever finds it set rebuilds the page table from
the slots (the source of truth): a SIGKILL mid-update leaks or doubly owns no page or block. Bytes are copied outside the
lock: a put reserves its place and a slot in state WRITING (invisible to lookups, never evicted
or moved), copies, then publishes it as LIVE under the lock, replacing an older entry of the same
key only then. A writer that dies mid-copy leaves a WRITING slot whose pid is gone; the next put
short of room reclaims it. Reads copy out under the lock, so neither eviction nor packing can
move bytes being read.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from mcpd.memory import shm_layout
from mcpd.memory.arena_stats import ArenaStats
from mcpd.memory.arena_blocks import CHAIN, FREE, ArenaBlocks
from mcpd.memory.file_lock import FileLock
from mcpd.memory.shm_layout import HEADER, MAGIC, SLOT_BYTES, Layout

EMPTY, WRITING, LIVE = 0, 1, 2        # slot states
END = 0xFFFFFFFF          # the last page of a chain links here
KINDS = 4   # entries_by_kind counts kinds 0 (unused) to 3, present or not: host_segment names them


class ArenaFull(Exception):
    """The entry does not fit, even with every evictable entry gone."""


class ShmArena:
    def __init__(self, path: Path, lock_path: Path):
        fd = os.open(path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.path, self.lock_path = path, lock_path
        self.lock = FileLock(lock_path)
        self.head = np.frombuffer(self.mm, HEADER, count=1)
        if self.head["magic"][0] != MAGIC:
            raise ValueError(f"{path} is not an mcpd cache segment of this version")
        layout = Layout(int(self.head["num_slots"][0]), int(self.head["num_pages"][0]), int(self.head["page_bytes"][0]))
        self.page_bytes, self.num_pages, self.num_slots = layout.page_bytes, layout.num_pages, layout.num_slots
        for name, column in shm_layout.columns(self.mm, layout).items():
            setattr(self, name, column)
        self.pages_at = layout.offsets()[1]
        self.blocks = ArenaBlocks(self.page_bytes, self.page_kind, self.blocks_used, self.bitmap)
        self.mem = memoryview(self.mm)
        self.own_pid = os.getpid()

    @classmethod
    def create(cls, path: Path, lock_path: Path, nbytes: int, page_bytes: int,
               half_life: float | None = None, num_slots: int | None = None) -> "ShmArena":
        """A new, empty segment at path of at most nbytes (replacing any stale one: nobody may
        still use it)."""
        layout = Layout.fitting(nbytes, page_bytes, num_slots)
        if layout.num_pages < 1:
            raise ValueError(f"{nbytes} bytes cannot hold one {page_bytes}-byte page")
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, layout.size)   # zeros: every slot EMPTY, every page FREE
            header = np.zeros(1, HEADER)
            header[0] = (MAGIC, page_bytes, layout.num_pages, layout.num_slots, 0,
                         half_life or max(16.0, layout.num_pages / 4), 0, 0, 0, 0, 0, 0, 0)
            os.pwrite(fd, header.tobytes(), 0)
        finally:
            os.close(fd)
        return cls(path, lock_path)

    # -- the API ----------------------------------------------------------------------------------

    def put(self, kind: int, key: bytes, parts: list, pinned: bool = False, replace: bool = False) -> bool:
        """Store the concatenation of parts (bytes-like) under (kind, key). Without replace, a key
        present (or being written) is left as it is and put returns False. Raises ArenaFull when
        it cannot fit."""
        if len(key) != 32:
            raise ValueError("keys are 32-byte digests")
        views = [memoryview(part).cast("B") for part in parts]
        slot = self._reserve(kind, key, sum(len(v) for v in views), pinned, replace)
        if slot is None:
            return False
        spans = self._spans(slot)
        for view in views:
            _scatter(view, spans, self.mem)
        self._publish(slot)
        return True

    def get(self, kind: int, key: bytes) -> bytearray | None:
        """A copy of the entry, counted as a hit (and a reference for eviction), or None, a miss."""
        with self._locked():
            slot = self._find(kind, key, LIVE)
            if slot is None:
                self._count("misses")
                return None
            self._count("hits")
            self._reference(slot)
            out = bytearray(int(self.nbytes[slot]))
            done = 0
            for at, n in self._spans(slot):
                out[done:done + n] = self.mem[at:at + n]
                done += n
            return out

    def contains(self, kind: int, key: bytes) -> bool:
        with self._locked():
            return self._find(kind, key, LIVE) is not None

    def delete(self, kind: int, key: bytes) -> bool:
        with self._locked():
            slot = self._find(kind, key, LIVE)
            if slot is not None:
                self._free(slot)
            return slot is not None

    def keys(self, kind: int) -> list[bytes]:
        with self._locked():
            found = np.flatnonzero((self.state == LIVE) & (self.kind == kind))
            return [self.key[i].tobytes() for i in found]

    def footprint(self, nbytes: int) -> int:
        """The bytes an entry of nbytes occupies: its block, or its whole pages, and its slot."""
        klass = self.blocks.class_of(nbytes)
        held = self.blocks.block_bytes(klass) if klass else self.blocks.pages_for(nbytes) * self.page_bytes
        return held + SLOT_BYTES

    @property
    def capacity_bytes(self) -> int:
        """What footprints are measured against: the pages and the slot table."""
        return self.num_pages * self.page_bytes + self.num_slots * SLOT_BYTES

    def stats(self) -> ArenaStats:
        with self._locked():
            live = self.state == LIVE
            head = {name: int(self.head[name][0])
                    for name in ("hits", "misses", "evictions", "inserts", "refused", "moved")}
            used_pages = int(np.count_nonzero(self.page_kind))
            stored = int(self.nbytes[live].sum())
            held = int(self.blocks.held_bytes(self.klass[live], self.npages[live]).sum())
            kinds = np.bincount(self.kind[live], minlength=KINDS)
        lookups = head["hits"] + head["misses"]
        return ArenaStats(self.num_pages * self.page_bytes, used_pages * self.page_bytes, held, stored, self.page_bytes,
                          int(live.sum()), self.num_slots, kinds.tolist(), **head,
                          hit_rate=round(head["hits"] / lookups, 4) if lookups else 0.0)

    # -- writing: reserve, copy, publish -------------------------------------------------------

    def _reserve(self, kind: int, key: bytes, nbytes: int, pinned: bool, replace: bool) -> int | None:
        klass = self.blocks.class_of(nbytes)
        npages = 1 if klass else self.blocks.pages_for(nbytes)
        with self._locked():
            if not replace and self._find(kind, key, LIVE, WRITING) is not None:
                return None
            self._make_room(klass, npages)
            slot = int(self.state.argmin())   # EMPTY is 0: the first free slot
            if klass:
                self.first[slot], self.block[slot] = self.blocks.take(klass)
            else:
                pages = np.flatnonzero(self.page_kind == FREE)[:npages]
                self.next[pages[:-1]] = pages[1:]
                self.next[pages[-1]] = END
                self.page_kind[pages] = CHAIN
                self.first[slot] = pages[0]
            fields = {"kind": kind, "pinned": pinned, "klass": klass, "pid": self.own_pid, "tag": _tag(key), "key": key,
                      "nbytes": nbytes, "npages": npages}
            for name, value in fields.items():
                getattr(self, name)[slot] = value
            self.state[slot] = WRITING   # last: until now the slot was EMPTY, its place an orphan
            return slot

    def _publish(self, slot: int) -> None:
        with self._locked():
            key, kind = self.key[slot].tobytes(), int(self.kind[slot])
            old = self._find(kind, key, LIVE)
            if old is not None:
                self._free(old)
            self._reference(slot, fresh=True)
            self.state[slot] = LIVE
            self._count("inserts")

    def _find(self, kind: int, key: bytes, *states: int) -> int | None:
        for slot in np.flatnonzero(self.tag == _tag(key)):
            if self.state[slot] in states and self.kind[slot] == kind and self.key[slot].tobytes() == key:
                return int(slot)
        return None

    # -- making room ------------------------------------------------------------------------------

    def _make_room(self, klass: int, npages: int) -> None:
        """A free slot, and npages free pages (or a free block of klass), or ArenaFull. Cheapest
        first: what dead writers held, then packing blocks, then evicting."""
        if self._has_room(klass, npages):
            return
        self._reclaim_dead_writers()
        if not self._has_room(klass, npages) and self.blocks.sparse_classes().size:
            self._defragment()
        if not self._has_room(klass, npages):
            self._evict(klass, npages)

    def _has_room(self, klass: int, npages: int) -> bool:
        return self.state.min() == EMPTY and self._pages_short(klass, npages) == 0

    def _pages_short(self, klass: int, npages: int) -> int:
        if klass and self.blocks.partial_pages(klass).size:
            return 0
        return max(0, npages - int(np.count_nonzero(self.page_kind == FREE)))

    def _evict(self, klass: int, npages: int) -> None:
        """Free evictable entries, lowest crf first, until the entry fits; refuse before
        evicting anything if it could not fit even with all of them gone."""
        evictable = np.flatnonzero((self.state == LIVE) & (self.pinned == 0))
        if not len(evictable) or self.num_pages - self._unevictable_pages() < npages:
            self._count("refused")
            raise ArenaFull(f"{npages} page(s) of {self.page_bytes} bytes are needed and the rest is pinned "
                            f"or being written ({self._unevictable_pages()} of {self.num_pages} pages)")
        order = evictable[np.argsort(self._crf_now(evictable), kind="stable")]
        # The fewest victims whose chains free the pages short (any victim frees a slot).
        freed = np.cumsum(np.where(self.klass[order] == 0, self.npages[order], 0).astype(np.int64))
        count = int(np.searchsorted(freed, self._pages_short(klass, npages))) + 1
        for slot in order[:count]:
            self._free(int(slot))
        for slot in order[count:]:   # blocks alone did not free whole pages: go on one by one
            if self._has_room(klass, npages):
                break
            self._free(int(slot))
            count += 1
        self._count("evictions", min(count, len(order)))
        if not self._has_room(klass, npages):
            self._defragment()
        if not self._has_room(klass, npages):
            self._count("refused")
            raise ArenaFull("blocks being written keep the pages needed")

    def _unevictable_pages(self) -> int:
        """The fewest pages that pinned and WRITING entries can be packed into."""
        kept = np.flatnonzero((self.state == WRITING) | ((self.state == LIVE) & (self.pinned != 0)))
        chains = kept[self.klass[kept] == 0]
        pages = int(self.npages[chains].sum())
        for klass, count in enumerate(np.bincount(self.klass[kept], minlength=self.blocks.num_classes + 1)):
            if klass and count:
                pages += -(-int(count) // self.blocks.per_page(klass))
        return pages

    def _reclaim_dead_writers(self) -> None:
        for slot in np.flatnonzero(self.state == WRITING):
            if not process_alive(int(self.pid[slot])):
                self._free(int(slot))

    # -- packing blocks ---------------------------------------------------------------------------

    def _defragment(self) -> None:
        """Pack each class's live blocks into its fullest pages, freeing the sparse ones. Blocks
        being written stay where they are (their writer copies into them outside the lock)."""
        for klass in self.blocks.sparse_classes().tolist():
            pages = np.flatnonzero(self.page_kind == CHAIN + klass)
            used = self.blocks_used[pages]
            keep = -(-int(used.sum()) // self.blocks.per_page(klass))
            sources = pages[np.argsort(-used.astype(np.int64), kind="stable")][keep:]
            movers = np.flatnonzero((self.klass == klass) & (self.state == LIVE) & np.isin(self.first, sources))
            for slot in movers:
                targets = np.setdiff1d(self.blocks.partial_pages(klass), sources, assume_unique=True)
                if not targets.size:
                    break
                self._move_block(int(slot), int(targets[np.argmax(self.blocks_used[targets])]))

    def _move_block(self, slot: int, page: int) -> None:
        (src, n), = self._spans(slot)
        old_page, old_block = int(self.first[slot]), int(self.block[slot])
        block = self.blocks.first_free(page, int(self.klass[slot]))
        self.blocks.mark(page, block, True)
        dst = self.pages_at + page * self.page_bytes + block * self.blocks.block_bytes(int(self.klass[slot]))
        self.mem[dst:dst + n] = self.mem[src:src + n]
        self.first[slot], self.block[slot] = page, block
        self.blocks.mark(old_page, old_block, False)
        self._count("moved")

    # -- freeing ----------------------------------------------------------------------------------

    def _free(self, slot: int) -> None:
        self.state[slot] = EMPTY   # first: a crash from here on leaves an orphan place, which repair frees
        if self.klass[slot]:
            self.blocks.mark(int(self.first[slot]), int(self.block[slot]), False)
        else:
            self.page_kind[self._chain(slot)] = FREE

    # -- eviction statistics ---------------------------------------------------------------------

    def _crf_now(self, slots: np.ndarray) -> np.ndarray:
        age = (self.head["clock"][0] - self.last[slots]).astype(np.float64)
        return self.crf[slots] * np.exp2(-age / self.head["half_life"][0])

    def _reference(self, slot: int, fresh: bool = False) -> None:
        clock = self.head["clock"][0] + 1
        self.head["clock"] = clock
        decayed = 0.0 if fresh else float(self._crf_now(np.array([slot]))[0])
        self.crf[slot] = 1.0 + decayed
        self.last[slot] = clock

    # -- pages ---------------------------------------------------------------------------------

    def _chain(self, slot: int) -> list[int]:
        pages, page = [], int(self.first[slot])
        for _ in range(int(self.npages[slot])):
            if page >= self.num_pages:
                break   # a link half rewritten when its writer died: _repair drops the entry
            pages.append(page)
            page = int(self.next[page])
        return pages

    def _spans(self, slot: int) -> list[list[int]]:
        """[address, length] of the entry's bytes: its block, or one span per run of consecutive pages."""
        left = int(self.nbytes[slot])
        if self.klass[slot]:
            at = int(self.first[slot]) * self.page_bytes + int(self.block[slot]) * self.blocks.block_bytes(int(self.klass[slot]))
            return [[self.pages_at + at, left]]
        spans = []
        for first, count in _runs(self._chain(slot)):
            n = min(count * self.page_bytes, left)
            spans.append([self.pages_at + first * self.page_bytes, n])
            left -= n
        return spans

    # -- the lock, and repair after a holder died ----------------------------------------------

    def _locked(self) -> "_Held":
        return _Held(self)

    def _repair(self) -> None:
        """Rebuild the page table from the slots after a lock holder died mid-update; an entry
        whose place conflicts with another's, or was half written, is dropped."""
        self.page_kind[:] = FREE
        self.blocks_used[:] = 0
        self.bitmap[:] = 0
        for slot in np.flatnonzero(self.state != EMPTY):
            if not (self._repair_block(int(slot)) if self.klass[slot] else self._repair_chain(int(slot))):
                self.state[slot] = EMPTY

    def _repair_chain(self, slot: int) -> bool:
        pages = self._chain(slot)
        if len(pages) != self.npages[slot] or len(set(pages)) != len(pages) or self.page_kind[pages].any():
            return False
        self.page_kind[pages] = CHAIN
        return True

    def _repair_block(self, slot: int) -> bool:
        page, block, klass = int(self.first[slot]), int(self.block[slot]), int(self.klass[slot])
        if (klass > self.blocks.num_classes or page >= self.num_pages or block >= self.blocks.per_page(klass)
                or self.page_kind[page] not in (FREE, CHAIN + klass) or self.blocks.taken(page, block)):
            return False
        self.page_kind[page] = CHAIN + klass
        self.blocks.mark(page, block, True)
        return True

    def _count(self, name: str, n: int = 1) -> None:
        self.head[name] = self.head[name][0] + n


class _Held:
    """The arena's lock, held: sets `dirty` on entry and clears it on exit, unless an unexpected
    error may have left an update half done (ArenaFull leaves every change complete)."""

    def __init__(self, arena: ShmArena):
        self.arena = arena

    def __enter__(self) -> None:
        self.arena.lock.__enter__()
        if self.arena.head["dirty"][0]:
            self.arena._repair()
        self.arena.head["dirty"] = 1

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None or exc_type is ArenaFull:
            self.arena.head["dirty"] = 0
        self.arena.lock.__exit__(exc_type, *exc)


def _tag(key: bytes) -> int:
    return int.from_bytes(key[:8], "little")


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    runs: list[list[int]] = []
    for page in pages:
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1][1] += 1
        else:
            runs.append([page, 1])
    return [(first, count) for first, count in runs]


def _scatter(view: memoryview, spans: list[list[int]], mem: memoryview) -> None:
    """Copy view into the front of spans, consuming them (a span partly filled is shortened)."""
    done = 0
    while done < len(view):
        at, room = spans[0]
        n = min(room, len(view) - done)
        mem[at:at + n] = view[done:done + n]
        done += n
        if n == room:
            spans.pop(0)
        else:
            spans[0] = [at + n, room - n]


def process_alive(pid: int) -> bool:
    """Whether pid runs; a zombie (killed, not yet reaped) does not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (FileNotFoundError, IndexError):
        return False
