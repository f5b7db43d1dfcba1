"""The device pool segment: regions taken, handed over to a dead owner's successor, freed and
coalesced, and a segment that is not certainly ours refused. In-process, on /dev/shm."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import torch
import pytest

from mcpd.memory import pool_segment
from mcpd.memory.pool_segment import KV, MIN_BLOCK, WEIGHTS, PoolBusy, PoolSegment, PoolTooSmall
from mcpd.refusal import StartRefused, UnsafePath

MIB = 1 << 20
KEY_A, KEY_B = b"a" * 32, b"b" * 32


@pytest.fixture
def paths(tmp_path):
    path = pool_segment.segment_path(tmp_path, "cpu")
    yield path, pool_segment.lock_path(tmp_path, "cpu")
    path.unlink(missing_ok=True)


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_a_region_is_taken_once_and_its_bytes_are_shared(paths):
    keeper = PoolSegment.create(*paths, 8 * MIB)
    worker = PoolSegment(*paths)
    region = worker.take(KV, 0, KEY_A, 3 * MIB + 5)
    assert region.offset % MIN_BLOCK == 0 and not region.reused
    worker.buffer(region)[:4] = torch.tensor(list(b"kept"))
    # Another mapping of the segment (the keeper's) sees the bytes and the region.
    assert bytes(keeper.buffer(region)[:4].tolist()) == b"kept"
    stats = keeper.stats()
    assert [(r.kind, r.owner, r.bytes) for r in stats.regions] == [("kv", 0, 3 * MIB + 5)]
    assert stats.requested_bytes == 3 * MIB + 5 and stats.in_use_bytes == 3 * MIB + MIN_BLOCK


def test_a_dead_owners_region_goes_to_its_successor_with_the_bytes(paths):
    PoolSegment.create(*paths, 8 * MIB)
    first = PoolSegment(*paths)
    region = first.take(KV, 3, KEY_A, MIB)
    first.buffer(region)[:5] = torch.tensor(list(b"hello"))
    first.pid[0] = dead_pid()   # as if the worker that took it had been SIGKILLed
    successor = PoolSegment(*paths)
    again = successor.take(KV, 3, KEY_A, MIB)
    assert again.reused and again.offset == region.offset and bytes(successor.buffer(again)[:5].tolist()) == b"hello"


def test_a_region_a_live_process_holds_is_not_handed_over(paths):
    PoolSegment.create(*paths, 8 * MIB)
    holder = PoolSegment(*paths)
    holder.take(KV, 0, KEY_A, MIB)
    holder.pid[0] = os.getppid()   # alive, and not us
    with pytest.raises(PoolBusy, match="still runs"):
        PoolSegment(*paths).take(KV, 0, KEY_A, MIB)


def test_other_contents_free_the_old_region_first(paths):
    segment = PoolSegment.create(*paths, 4 * MIB)
    segment.take(KV, 0, KEY_A, 3 * MIB)
    replaced = segment.take(KV, 0, KEY_B, 3 * MIB)   # would not fit beside the old one
    assert not replaced.reused and len(segment.stats().regions) == 1


def test_a_pool_too_small_refuses_with_the_numbers(paths):
    segment = PoolSegment.create(*paths, 4 * MIB)
    segment.take(WEIGHTS, 0, KEY_A, 3 * MIB)
    with pytest.raises(PoolTooSmall, match=r"POOL_TOO_SMALL: worker 1 needs a kv region of 2097152 bytes; "
                                           r"the device pool has 1048576 of 4194304 bytes free"):
        segment.take(KV, 1, KEY_A, 2 * MIB)


def test_freeing_a_workers_regions_coalesces(paths):
    segment = PoolSegment.create(*paths, 32 * MIB)
    for owner in range(4):
        segment.take(WEIGHTS, owner, KEY_A, MIB + 100)
        segment.take(KV, owner, KEY_A, 2 * MIB + 100)
    for owner in (0, 2, 1, 3):
        assert segment.release(owner) == 2
    stats = segment.stats()
    assert stats.regions == [] and stats.largest_free_block == stats.free_bytes == 32 * MIB


def test_a_removed_workers_regions_coalesce_with_their_free_neighbours(paths):
    segment = PoolSegment.create(*paths, 16 * MIB)
    for owner in range(3):   # laid out in order: 0's weights and KV, 1's, 2's, then 7 MiB free
        segment.take(WEIGHTS, owner, KEY_A, MIB)
        segment.take(KV, owner, KEY_A, 2 * MIB)
    with pytest.raises(PoolTooSmall):
        segment.take(KV, 3, KEY_A, 8 * MIB)
    assert segment.release(1) == 2
    assert segment.stats().largest_free_block == 7 * MIB   # 1's 3 MiB are one run, apart from the end
    assert segment.release(2) == 2
    stats = segment.stats()   # 1's and 2's regions and the free end: one run of 13 MiB
    assert stats.largest_free_block == stats.free_bytes == 13 * MIB and stats.external_fragmentation == 0
    assert segment.take(KV, 3, KEY_A, 13 * MIB).offset == 3 * MIB


def test_a_live_workers_regions_are_not_released(paths):
    PoolSegment.create(*paths, 8 * MIB)
    holder = PoolSegment(*paths)
    holder.take(WEIGHTS, 1, KEY_A, MIB)
    holder.take(KV, 1, KEY_A, MIB)
    holder.pid[1] = os.getppid()   # one of them held by a process that runs, not the caller
    with pytest.raises(PoolBusy, match="still runs"):
        PoolSegment(*paths).release(1)
    assert len(holder.stats().regions) == 2   # neither freed
    holder.pid[1] = dead_pid()
    assert PoolSegment(*paths).release(1) == 2


@pytest.mark.parametrize("damage", ["mode", "magic", "version", "size", "link"])
def test_a_segment_that_is_not_certainly_ours_is_refused(paths, request, damage):
    path, lock = paths
    PoolSegment.create(path, lock, 4 * MIB)
    if damage == "mode":
        os.chmod(path, 0o644)
    elif damage in ("magic", "version"):
        field = np.dtype(pool_segment.HEADER).fields[damage][1]
        with open(path, "r+b") as f:
            f.seek(field)
            f.write(b"\x07" * 8)
    elif damage == "size":
        os.truncate(path, os.path.getsize(path) + MIN_BLOCK)
    else:
        target = path.with_name(path.name + "-elsewhere")
        os.rename(path, target)
        os.symlink(target, path)
        request.addfinalizer(lambda: target.unlink(missing_ok=True))
    with pytest.raises((StartRefused, OSError)) as refused:
        PoolSegment(path, lock)
    if damage == "mode":
        assert isinstance(refused.value, UnsafePath) and "mode 644" in str(refused.value)


def test_a_region_table_no_allocator_could_have_made_is_refused(paths):
    segment = PoolSegment.create(*paths, 4 * MIB)
    segment.take(KV, 0, KEY_A, MIB)
    segment.take(KV, 1, KEY_A, MIB)
    segment.offset[1] = segment.offset[0] + MIN_BLOCK   # overlapping regions
    with pytest.raises(ValueError, match="overlaps"):
        segment.take(KV, 2, KEY_A, MIB)


@pytest.mark.parametrize("nbytes", [2 ** 63, 2 ** 40 * 1024])
def test_a_pool_larger_than_its_tmpfs_is_refused_with_the_numbers(paths, nbytes):
    with pytest.raises(StartRefused, match="does not fit .* bytes free"):
        PoolSegment.create(*paths, nbytes)
    assert not paths[0].exists()


def test_a_view_outside_the_pool_is_never_handed_out(paths):
    segment = PoolSegment.create(*paths, 4 * MIB)
    with pytest.raises(ValueError, match="outside"):
        segment.buffer(pool_segment.Region(3 * MIB, 2 * MIB, False))
