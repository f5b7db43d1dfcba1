"""A key-value arena in one host shared-memory segment, shared by every mcpd process.

The scheduler keeps committed contexts in it and every worker KV blocks (keyed by their chain
hash), so any process can find what another wrote, and a crash of the writer loses nothing it
published. Its state lives in the segment itself, never in a process:

    header | slot table (one 80-byte slot per page) | next-page links | page-in-use flags | pages

Allocator: fixed pages (cache.page_bytes) chained through the `next` links. An entry of n bytes
takes ceil(n / page) pages, so it wastes under one page, whatever the mix of sizes, and the
arena never fragments: any free page serves any entry. Free pages are taken lowest-address
first, so an entry's pages are mostly consecutive and are copied as a few long runs. (The buddy
allocator in buddy.py keeps its free lists in Python objects, which other processes cannot see.)

Index: the slot table. A slot holds an entry's kind, 32-byte key (BLAKE2b digests: KV chain
hashes, context ids), size, first page, and its eviction statistics; lookups match the key's
first 8 bytes over the whole table with numpy, then compare the full key. There are as many
slots as pages and every entry holds at least one page, so a slot is free whenever pages are.

Eviction: LRFU (Lee et al., 2001), which spans recency and frequency with one parameter. Each
entry carries a combined recency-frequency value, crf = sum over its past references of
2^(-age / half_life), where age counts cache accesses (puts and hits) since that reference. A
one-off entry decays from 1; an entry hit k times recently is worth about k; an entry hit often
long ago decays like an old one-off. The lowest crf goes first. half_life defaults to a quarter of
the page count, so a reference's weight halves while about a quarter of the cache turns over:
a block reused every turn of a live chat outlives a burst of one-off prompts, while a chat that
went quiet fades out. Pinned entries (contexts: committed state) are never evicted; a put that
cannot fit after evicting everything else raises ArenaFull.

Crash safety. All metadata changes happen under a FileLock (the kernel releases it if the holder
dies). The holder sets `dirty` in the header first and clears it last; whoever next takes the
lock and finds it set rebuilds the page flags and links from the slots (the source of truth),
so a SIGKILL mid-update leaves no leaked or doubly owned page. Bytes are copied outside the
lock: a put reserves pages and a slot in state WRITING (invisible to lookups, never evicted),
copies, then publishes it as LIVE under the lock, replacing an older entry of the same key only
then. A writer that dies mid-copy leaves a WRITING slot whose pid is gone; the next put reclaims
it. Reads copy out under the lock, so eviction cannot reuse pages being read.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from mcpd.memory.file_lock import FileLock

MAGIC = 0x6D63706461726E31   # "mcpdarn1"
HEADER = np.dtype([("magic", "<u8"), ("page_bytes", "<u8"), ("num_pages", "<u8"), ("dirty", "<u8"),
                   ("half_life", "<f8"), ("clock", "<u8"), ("hits", "<u8"), ("misses", "<u8"),
                   ("evictions", "<u8"), ("inserts", "<u8"), ("refused", "<u8")])
SLOT = np.dtype([("state", "u1"), ("kind", "u1"), ("pinned", "u1"), ("pad", "u1"), ("pid", "<i4"),
                 ("tag", "<u8"), ("key", "V32"), ("nbytes", "<u8"), ("first", "<u4"), ("npages", "<u4"),
                 ("last", "<u8"), ("crf", "<f8")])
EMPTY, WRITING, LIVE = 0, 1, 2
END = 0xFFFFFFFF          # the last page of a chain links here
ALIGN = 4096
PER_PAGE_OVERHEAD = SLOT.itemsize + 4 + 1   # slot, next link, in-use flag
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
            raise ValueError(f"{path} is not an mcpd cache segment")
        self.page_bytes, self.num_pages = int(self.head["page_bytes"][0]), int(self.head["num_pages"][0])
        self.slots = np.frombuffer(self.mm, SLOT, self.num_pages, ALIGN)
        links_at = ALIGN + self.slots.nbytes
        self.next = np.frombuffer(self.mm, "<u4", self.num_pages, links_at)
        self.used = np.frombuffer(self.mm, "u1", self.num_pages, links_at + self.next.nbytes)
        self.pages_at = _aligned(links_at + self.next.nbytes + self.used.nbytes)
        self.mem = memoryview(self.mm)
        self.pid = os.getpid()

    @classmethod
    def create(cls, path: Path, lock_path: Path, nbytes: int, page_bytes: int,
               half_life: float | None = None) -> "ShmArena":
        """A new, empty segment at path (replacing any stale one: nobody may still use it)."""
        num_pages = (nbytes - 3 * ALIGN) // (page_bytes + PER_PAGE_OVERHEAD)
        if num_pages < 1:
            raise ValueError(f"{nbytes} bytes cannot hold one {page_bytes}-byte page")
        size = _aligned(_aligned(ALIGN + num_pages * SLOT.itemsize + num_pages * 5) + num_pages * page_bytes)
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)   # zeros: every slot EMPTY, every page free
            header = np.zeros(1, HEADER)
            header[0] = (MAGIC, page_bytes, num_pages, 0, half_life or max(16.0, num_pages / 4), 0, 0, 0, 0, 0, 0)
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
            out = bytearray(int(self.slots["nbytes"][slot]))
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
            found = np.flatnonzero((self.slots["state"] == LIVE) & (self.slots["kind"] == kind))
            return [self.slots["key"][i].tobytes() for i in found]

    def stats(self) -> dict:
        with self._locked():
            live = self.slots["state"] == LIVE
            head = {name: int(self.head[name][0]) for name in ("hits", "misses", "evictions", "inserts", "refused")}
            used_pages = int(np.count_nonzero(self.used))
            stored = int(self.slots["nbytes"][live].sum())
            kinds = np.bincount(self.slots["kind"][live], minlength=KINDS)
        lookups = head["hits"] + head["misses"]
        return {"total_bytes": self.num_pages * self.page_bytes, "used_bytes": used_pages * self.page_bytes,
                "stored_bytes": stored, "page_bytes": self.page_bytes, "entries": int(live.sum()),
                "entries_by_kind": kinds.tolist(), **head,
                "hit_rate": round(head["hits"] / lookups, 4) if lookups else 0.0}

    # -- writing: reserve, copy, publish -------------------------------------------------------

    def _reserve(self, kind: int, key: bytes, nbytes: int, pinned: bool, replace: bool) -> int | None:
        npages = max(1, -(-nbytes // self.page_bytes))
        with self._locked():
            self._reclaim_dead_writers()
            if not replace and self._find(kind, key, LIVE, WRITING) is not None:
                return None
            pages = self._take_pages(npages)
            slot = int(np.flatnonzero(self.slots["state"] == EMPTY)[0])
            self.next[pages[:-1]] = pages[1:]
            self.next[pages[-1]] = END
            self.used[pages] = 1
            fields = {"kind": kind, "pinned": pinned, "pid": self.pid, "tag": _tag(key), "key": key,
                      "nbytes": nbytes, "first": pages[0], "npages": npages}
            for name, value in fields.items():
                self.slots[name][slot] = value
            self.slots["state"][slot] = WRITING   # last: until now the slot was EMPTY, the pages orphans
            return slot

    def _publish(self, slot: int) -> None:
        with self._locked():
            key, kind = self.slots["key"][slot].tobytes(), int(self.slots["kind"][slot])
            old = self._find(kind, key, LIVE)
            if old is not None:
                self._free(old)
            self._reference(slot, fresh=True)
            self.slots["state"][slot] = LIVE
            self._count("inserts")

    def _find(self, kind: int, key: bytes, *states: int) -> int | None:
        for slot in np.flatnonzero(self.slots["tag"] == _tag(key)):
            if (self.slots["state"][slot] in states and self.slots["kind"][slot] == kind
                    and self.slots["key"][slot].tobytes() == key):
                return int(slot)
        return None

    def _take_pages(self, npages: int) -> np.ndarray:
        short = npages - (self.num_pages - int(np.count_nonzero(self.used)))
        if short > 0:
            self._evict(short)
        return np.flatnonzero(self.used == 0)[:npages]

    def _evict(self, npages: int) -> None:
        """Free evictable entries, lowest crf first, until npages more pages are free."""
        evictable = np.flatnonzero((self.slots["state"] == LIVE) & (self.slots["pinned"] == 0))
        order = evictable[np.argsort(self._crf_now(evictable), kind="stable")]
        freed = np.cumsum(self.slots["npages"][order].astype(np.int64))
        if not len(order) or freed[-1] < npages:
            self._count("refused")
            raise ArenaFull(f"{npages} more pages of {self.page_bytes} bytes are needed; "
                            f"{int(freed[-1]) if len(order) else 0} could be evicted")
        victims = order[:int(np.searchsorted(freed, npages)) + 1]
        for slot in victims:
            self._free(int(slot))
        self._count("evictions", len(victims))

    def _reclaim_dead_writers(self) -> None:
        for slot in np.flatnonzero(self.slots["state"] == WRITING):
            if not _alive(int(self.slots["pid"][slot])):
                self._free(int(slot))

    def _free(self, slot: int) -> None:
        pages = self._chain(slot)
        self.slots["state"][slot] = EMPTY   # first: a crash from here on leaves orphan pages, which repair frees
        self.used[pages] = 0

    # -- eviction statistics ---------------------------------------------------------------------

    def _crf_now(self, slots: np.ndarray) -> np.ndarray:
        age = (self.head["clock"][0] - self.slots["last"][slots]).astype(np.float64)
        return self.slots["crf"][slots] * np.exp2(-age / self.head["half_life"][0])

    def _reference(self, slot: int, fresh: bool = False) -> None:
        clock = self.head["clock"][0] + 1
        self.head["clock"] = clock
        decayed = 0.0 if fresh else float(self._crf_now(np.array([slot]))[0])
        self.slots["crf"][slot] = 1.0 + decayed
        self.slots["last"][slot] = clock

    # -- pages ---------------------------------------------------------------------------------

    def _chain(self, slot: int) -> list[int]:
        pages, page = [], int(self.slots["first"][slot])
        for _ in range(int(self.slots["npages"][slot])):
            if page >= self.num_pages:
                break   # a link half rewritten when its writer died: _repair drops the entry
            pages.append(page)
            page = int(self.next[page])
        return pages

    def _spans(self, slot: int) -> list[list[int]]:
        """[address, length] of the entry's bytes, one span per run of consecutive pages."""
        spans, left = [], int(self.slots["nbytes"][slot])
        for first, count in _runs(self._chain(slot)):
            n = min(count * self.page_bytes, left)
            spans.append([self.pages_at + first * self.page_bytes, n])
            left -= n
        return spans

    # -- the lock, and repair after a holder died ----------------------------------------------

    def _locked(self) -> "_Held":
        return _Held(self)

    def _repair(self) -> None:
        """Rebuild page flags and links from the slots after a lock holder died mid-update."""
        self.used[:] = 0
        for slot in np.flatnonzero(self.slots["state"] != EMPTY):
            pages = self._chain(int(slot))
            if len(pages) != self.slots["npages"][slot] or len(set(pages)) != len(pages) or self.used[pages].any():
                self.slots["state"][slot] = EMPTY   # its links were being rewritten: drop it
                continue
            self.used[pages] = 1

    def _count(self, name: str, n: int = 1) -> None:
        self.head[name] = self.head[name][0] + n


class _Held:
    """The arena's lock, held: sets `dirty` on entry and clears it on exit, unless an unexpected
    error may have left an update half done (ArenaFull is raised before anything changes)."""

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


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


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


def _alive(pid: int) -> bool:
    """Whether pid runs; a zombie (killed, not yet reaped) does not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (FileNotFoundError, IndexError):
        return False
