"""Context storage against a hostile tenant and a damaged disk, each beside its baseline.

    python bench/storage.py [--quick]

1. Host cache per tenant: one tenant's 1024 contexts, each committed a few scalars, on the
   default cache (256 MiB, 16 KiB pages). What the store counts (field bytes), what the cache
   charges the tenant (footprints: block or pages, and slot), what the arena really holds for it
   (pages in use and slots), and what the page-per-entry allocator of the first format held for the
   same entries (one page each).
2. Contexts reachable: empty contexts opened (64 tenants x 1024) on the default cache until
   refused, against the pages the page-per-entry arena had (one empty context each).
3. Control ops during big commits, through the daemon: another tenant's context.list latency
   while one tenant commits to a context at contexts.max_fields (4096 scalar fields) from two
   clients, changing 1 field a commit, then 1024 (the most one update may carry), against the
   same list on the idle daemon; interleaved rounds.
4. Journal recovery: 4 contexts x 30 commits (124 records), one bit flipped in record 12: the
   records read back out of those still intact, by format 2 and by a format 1 reader of the same
   records (which stops at the damage), and the contexts that came back whole.
Last line JSON with the figures.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import struct
import tempfile
import threading
import time
import uuid
import zlib
from pathlib import Path

from mcpd.config import from_dict
from mcpd.contexts import journal_file
from mcpd.contexts.persistence import Persistence, open_store
from mcpd.memory.host_segment import CONTEXT, CONTEXT_DELTA
from mcpd.memory.shm_arena import ShmArena
from mcpd.memory.shm_layout import SLOT_BYTES
from mcpd.percentile import percentile
from mcpd.protocol import delta as codec
from mcpd.protocol.codes import MCPDError
from mcpd.testing import Daemon

CACHE_BYTES, PAGE = 256 << 20, 16 << 10
PER_TENANT = 1024
FIELDS = 4096
LOG = logging.getLogger("bench")


def cached_store(workdir: Path) -> tuple[Persistence, ShmArena]:
    """The scheduler's store on the default cache, without the journal."""
    arena = ShmArena.create(Path(f"/dev/shm/mcpd-bench-{uuid.uuid4().hex[:12]}"), workdir / "cache.lock",
                            CACHE_BYTES, PAGE)
    return open_store(from_dict({"persistence": {"enabled": False}}), arena, LOG), arena


def cache_per_tenant(workdir: Path, commits: int) -> dict:
    persistence, arena = cached_store(workdir)
    store = persistence.store
    try:
        for i in range(PER_TENANT):
            store.open("hog", f"c{i}")
            for version in range(commits):
                store.update("hog", f"c{i}", version, [codec.diff("n", None, version)])
        sizes = [len(arena.get(kind, key)) for kind in (CONTEXT, CONTEXT_DELTA) for key in arena.keys(kind)]
        stats = arena.stats()
        return {"store_counted_bytes": store.bytes_of["hog"], "cache_charged_bytes": persistence.cache.usage["hog"].bytes,
                "cache_held_bytes": stats.used_bytes + stats.entries * SLOT_BYTES,
                "page_per_entry_bytes": sum(-(-n // PAGE) * PAGE for n in sizes), "entries": len(sizes)}
    finally:
        arena.path.unlink()


def contexts_reachable(workdir: Path, tenants: int) -> dict:
    persistence, arena = cached_store(workdir)
    store, opened, refused = persistence.store, 0, ""
    started = time.perf_counter()
    try:
        for tenant in range(tenants):
            for i in range(PER_TENANT):
                try:
                    store.open(f"t{tenant}", f"c{i}")
                except MCPDError as e:
                    refused = e.message
                    break
                opened += 1
            if refused:
                break
        # The first arena gave each entry an 85-byte slot and a whole page.
        old_pages = (CACHE_BYTES - 3 * 4096) // (PAGE + 85)
        return {"reachable": opened, "refused": refused, "page_per_entry": old_pages,
                "seconds": time.perf_counter() - started}
    finally:
        arena.path.unlink()


def list_latency(quick: bool) -> dict:
    """context.list latencies (ms) idle and during commits of each size, and the commits' own."""
    d = Daemon(workers={"count": 1}).start()
    try:
        wide = [d.client() for _ in range(2)]
        wide[0].call("context.open", {"id": "wide"})
        fill_fields(wide[0])
        with d.client(tenant="lister") as lister:
            for i in range(10):
                lister.call("context.open", {"id": f"mine{i}"})
            lists = {"idle": [], 1: [], 1024: []}
            commits = {1: [], 1024: []}
            for _ in range(3 if quick else 8):
                lists["idle"] += timed_lists(lister, 100)
                for changed in commits:
                    lists[changed] += lists_during_commits(lister, wide, changed, commits[changed])
        for c in wide:
            c.close()
    finally:
        d.stop()
        d.cleanup()
    return {"lists": lists, "commits": commits}


def lists_during_commits(lister, committers: list, changed: int, took: list) -> list[float]:
    stop = threading.Event()
    threads = [threading.Thread(target=commit_loop, args=(c, changed, stop, took)) for c in committers]
    for t in threads:
        t.start()
    try:
        return timed_lists(lister, 100)
    finally:
        stop.set()
        for t in threads:
            t.join()


def fill_fields(client) -> None:
    """The context "wide" of the default tenant at contexts.max_fields scalar fields."""
    for start in range(0, FIELDS, 1024):
        version = client.call("context.get", {"id": "wide", "since": 0})["version"]
        entries, frames = codec.to_wire([codec.diff(f"f{i}", None, i) for i in range(start, start + 1024)])
        client.call_with_payload("context.update", {"id": "wide", "base": version, "changes": entries}, frames)


def commit_loop(client, changed: int, stop: threading.Event, took: list) -> None:
    """`changed` fields a commit; on CONFLICT (the other client got there first) fetch only what
    changed since (a get since 0 would send all the fields: a big op of its own)."""
    version = client.call("context.get", {"id": "wide", "since": 0})["version"]
    step = 0
    while not stop.is_set():
        step += 1
        entries, frames = codec.to_wire([codec.diff(f"f{i}", None, step) for i in range(changed)])
        started = time.perf_counter()
        try:
            result, _ = client.call_with_payload("context.update", {"id": "wide", "base": version, "changes": entries},
                                                 frames)
        except MCPDError:
            version = client.call("context.get", {"id": "wide", "since": version})["version"]
            continue
        took.append((time.perf_counter() - started) * 1e3)
        version = result["version"]


def timed_lists(client, count: int) -> list[float]:
    took = []
    for _ in range(count):
        started = time.perf_counter()
        client.call("context.list", {})
        took.append((time.perf_counter() - started) * 1e3)
        time.sleep(0.002)
    return took


def journal_recovery(workdir: Path) -> dict:
    config = from_dict({"server": {"state_dir": str(workdir / "state")}})
    persistence = open_store(config, None, LOG)
    store, journal = persistence.store, persistence.journal
    offsets, bodies = [], []
    for context_id in ("a", "b", "c", "d"):
        offsets.append(journal.size)
        store.open("t", context_id)
    for step in range(30):
        for context_id in ("a", "b", "c", "d"):
            offsets.append(journal.size)
            store.update("t", context_id, step, [codec.diff("n", None, step)])
    journal.close()
    path = workdir / "state" / "contexts" / "journal-0.log"
    data = bytearray(path.read_bytes())
    for start, end in zip(offsets, offsets[1:] + [len(data)]):
        bodies.append(bytes(data[start + journal_file.HEADER.size:end]))
    data[offsets[11] + 30] ^= 0x10   # record 12 of 124
    path.write_bytes(data)
    intact = len(bodies) - 1
    format1 = bytearray(b"".join(struct.pack("<II", len(b), zlib.crc32(b)) + b for b in bodies))
    format1[sum(8 + len(b) for b in bodies[:11]) + 30] ^= 0x10
    (workdir / "v1.log").write_bytes(format1)
    read_v1 = len(journal_file.read(workdir / "v1.log").records)
    read_v2 = len(journal_file.read(path).records)
    recovered = open_store(config, None, LOG)
    restored = recovered.store
    whole = sum(restored.get("t", c).version == 30 for c in ("a", "b", "c", "d"))
    recovered.journal.close()
    return {"intact": intact, "read_v2": read_v2, "read_v1": read_v1, "contexts_whole": whole}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        cache = cache_per_tenant(workdir, commits=2 if args.quick else 8)
        reach = contexts_reachable(workdir, tenants=64)
        journal = journal_recovery(workdir)
    latency = list_latency(args.quick)
    p99 = {name: percentile(xs, 0.99) for name, xs in latency["lists"].items()}
    p50 = {name: statistics.median(xs) for name, xs in latency["lists"].items()}
    commit_ms = {changed: statistics.median(took) for changed, took in latency["commits"].items()}
    print(f"1. one tenant, {PER_TENANT} contexts of scalar commits ({cache['entries']} cache entries): store counts "
          f"{cache['store_counted_bytes']} B, cache charges {cache['cache_charged_bytes']} B, arena holds "
          f"{cache['cache_held_bytes']} B; a page per entry held {cache['page_per_entry_bytes']} B")
    print(f"2. contexts reachable on a {CACHE_BYTES >> 20} MiB cache: {reach['reachable']} in {reach['seconds']:.1f} s "
          f"(page per entry: {reach['page_per_entry']}){'; refused: ' + reach['refused'] if reach['refused'] else ''}")
    print(f"3. another tenant's context.list p50/p99: idle {p50['idle']:.2f}/{p99['idle']:.2f} ms; during commits to "
          f"a context of {FIELDS} fields changing 1 field {p50[1]:.2f}/{p99[1]:.2f} ms (a commit {commit_ms[1]:.1f} "
          f"ms), changing 1024 {p50[1024]:.2f}/{p99[1024]:.2f} ms (a commit {commit_ms[1024]:.1f} ms)")
    print(f"4. journal, one bit in record 12 of {journal['intact'] + 1}: records read back {journal['read_v2']} "
          f"of {journal['intact']} intact (format 1 reader: {journal['read_v1']}); "
          f"contexts whole {journal['contexts_whole']} of 4")
    print(json.dumps({
        "cache_store_counted_bytes": cache["store_counted_bytes"],
        "cache_charged_bytes": cache["cache_charged_bytes"],
        "cache_held_bytes": cache["cache_held_bytes"],
        "cache_page_per_entry_bytes": cache["page_per_entry_bytes"],
        "cache_held_over_charged": round(cache["cache_held_bytes"] / cache["cache_charged_bytes"], 3),
        "cache_page_per_entry_over_held": round(cache["page_per_entry_bytes"] / cache["cache_held_bytes"], 1),
        "contexts_reachable": reach["reachable"], "contexts_reachable_page_per_entry": reach["page_per_entry"],
        "list_p99_ms_idle": round(p99["idle"], 2), "list_p99_ms_during_1_field_commits": round(p99[1], 2),
        "list_p99_ms_during_1024_field_commits": round(p99[1024], 2),
        "commit_ms_1_field_at_field_limit": round(commit_ms[1], 2),
        "commit_ms_1024_fields_at_field_limit": round(commit_ms[1024], 2),
        "journal_records_intact": journal["intact"], "journal_records_read": journal["read_v2"],
        "journal_records_read_format1": journal["read_v1"], "journal_contexts_whole": journal["contexts_whole"]}))


if __name__ == "__main__":
    main()
