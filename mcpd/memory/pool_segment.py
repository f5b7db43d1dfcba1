"""One device's pool in a POSIX shared-memory segment: the pool keeper creates it once, every
worker on the device maps it and takes its regions from it, and what a worker wrote there
outlives the worker (its KV blocks: engine/kv_records.py).

    header | region table (one row per region, as columns) | the pool's bytes

The region table is the pool's whole allocation state: a region is (kind, owner, key, offset,
requested bytes), and the allocator (region_allocator.py: a buddy whose regions may span
adjacent free blocks) is rebuilt from the live rows whenever a region is taken
(BuddyAllocator.restored), so no process holds state the others cannot see. Regions are
few (a worker's weights and KV), so the rebuild costs microseconds. Changes happen under
a FileLock (the kernel drops it when its holder dies); a row becomes LIVE by its state byte,
written last, and FREE by it, written first, so a holder SIGKILLed mid-update leaves no
half-made region.

A region's key says what it holds (engine.py derives the KV region's from the model and the
cache's layout): a worker restarted under the same owner index asks for the same key and size
and gets its predecessor's region back, with the bytes in it; a different key frees the old
region first. Only a dead predecessor's region is handed over: one whose recorded pid still
runs is refused (PoolBusy).

The segment is trusted only after checks, since /dev/shm is shared with every user: opened
without following links, it must be a regular file of our uid, mode 0600, with this version's
magic, and exactly the size its header implies; the table's rows must be a live set an
allocator could have granted, and every view handed out lies inside the pool.

On a GPU the pool's bytes are one device allocation the keeper makes and exports through
CUDA IPC (cuda_ipc.py); the segment then holds the header (with the IPC handle and the device's
index) and the region table only, and a worker opens the handle and views (offset, length) in
it instead of slicing this mapping. The table, locking, keys and the bounds check are the same
on both. What lies in the regions is device-neutral: the weights' region holds the forms the
device's kernels read (engine/resident_weights.py; on CUDA the torch kernels' plain matrices),
and the validity records (its own and the KV blocks', engine/kv_records.py) lie in the regions
too, written by the same CUDA stream after the bytes they vouch for: the stream runs in order,
so a flag is never ahead of its bytes, and a SIGKILL drops what was queued behind, not before.
A GPU step's activations come from torch's caching allocator, outside the pool; the CPU's need
no region either (native_stack.py says why).
"""
from __future__ import annotations

import mmap
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mcpd.memory import cuda_ipc, host_segment
from mcpd.memory.pool_stats import PoolRegion, PoolStats
from mcpd.memory.buddy import OutOfPoolMemory
from mcpd.memory.region_allocator import RegionAllocator
from mcpd.memory.file_lock import FileLock
from mcpd.memory.shm_arena import process_alive
from mcpd.memory.shm_layout import ALIGN, COLUMN_ALIGN, aligned
from mcpd.refusal import StartRefused, UnsafePath

if TYPE_CHECKING:   # torch only where a pool's bytes are used: the supervisor imports this module
    import torch

MAGIC = 0x6C6F6F7064706D63   # "mcpdpool"
VERSION = 2   # 2: the device and its IPC handle
HEADER = np.dtype([("magic", "<u8"), ("version", "<u8"), ("total_bytes", "<u8"), ("min_block", "<u8"),
                   ("num_regions", "<u8"), ("keeper_pid", "<i8"),
                   ("cuda_index", "<i8"),   # ON_HOST: the bytes follow the table; else a CUDA device's index
                   ("ipc_handle", f"V{cuda_ipc.HANDLE_BYTES}")])   # the device allocation's, exported by the keeper
ON_HOST = -1
MAX_CUDA_INDEX = 63
REGION_COLUMNS = (("state", "u1"), ("kind", "u1"), ("owner", "<i4"),
                  ("pid", "<i4"),       # the process that took (or took over) the region last
                  ("offset", "<u8"),    # into the pool's bytes
                  ("nbytes", "<u8"),    # requested; the buddy grants it rounded up to min_block
                  ("key", "V32"))
FREE, LIVE = 0, 1
WEIGHTS, KV = 1, 2   # no scratch region on the CPU: native_stack.py says why
KIND_NAMES = {WEIGHTS: "weights", KV: "kv"}
NUM_REGIONS = 64
MIN_BLOCK = 4096   # a page: regions are large, and page-aligned ones map and zero cleanly
SEGMENT_MODE = 0o600
ATTACH_POLL_S = 0.05


class PoolBusy(StartRefused):
    """A live process other than the caller holds the region asked for."""


class PoolTooSmall(StartRefused):
    """The device pool cannot hold a worker's region: the message has the numbers."""


@dataclass(frozen=True)
class Region:
    offset: int
    nbytes: int
    reused: bool   # a predecessor's, with its bytes


def segment_path(runtime_dir: Path, device: str) -> Path:
    """Beside the host cache's segment, named after the daemon's runtime dir and the device."""
    return host_segment.segment_path(runtime_dir).with_name(
        f"{host_segment.segment_path(runtime_dir).name}-pool-{device.replace(':', '')}")


def every_segment(runtime_dir: Path) -> list[Path]:
    """The pool segments of the daemon on runtime_dir, whatever their devices."""
    name = host_segment.segment_path(runtime_dir).name
    return sorted(host_segment.SHM_DIR.glob(f"{name}-pool-*"))


def lock_path(runtime_dir: Path, device: str) -> Path:
    return runtime_dir / f"pool-{device.replace(':', '')}.lock"


def attach_when_kept(runtime_dir: Path, device: str, timeout_s: float) -> "PoolSegment":
    """The device's segment once its keeper has made it: a worker may start before the keeper
    (or while a dead keeper's successor replaces the segment, whose keeper_pid is then gone)."""
    path, deadline = segment_path(runtime_dir, device), time.monotonic() + timeout_s
    while True:
        if os.path.lexists(path):
            segment = PoolSegment(path, lock_path(runtime_dir, device))
            if process_alive(segment.keeper_pid):
                return segment
            segment.close()
        if time.monotonic() > deadline:
            raise TimeoutError(f"no device pool at {path} kept by a live pool keeper after {timeout_s:.0f}s")
        time.sleep(ATTACH_POLL_S)


def layout(total_bytes: int, num_regions: int, on_host: bool) -> tuple[dict[str, int], int, int]:
    """Each column's offset, where the pool's bytes begin, and the segment's size (which holds
    the pool's bytes only when they are on the host)."""
    at, where = aligned(HEADER.itemsize, COLUMN_ALIGN), {}
    for name, kind in REGION_COLUMNS:
        where[name] = at
        at = aligned(at + num_regions * np.dtype(kind).itemsize, COLUMN_ALIGN)
    data_at = aligned(at, ALIGN)
    return where, data_at, data_at + total_bytes * on_host


def cuda_index(device: str) -> int:
    """ON_HOST for "cpu", else the CUDA device's index ("cuda" is device 0)."""
    if device == "cpu":   # without torch: the CPU pool keeper never loads it
        return ON_HOST
    import torch

    device = torch.device(device)
    return ON_HOST if device.type == "cpu" else (device.index or 0)


class PoolSegment:
    def __init__(self, path: Path, lock_path: Path):
        """Map an existing segment, refusing one that is not certainly ours and whole."""
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = _checked_file(path, fd)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path, self.lock = path, FileLock(lock_path)
        self.head = np.frombuffer(self.mm, HEADER, count=1)
        self.total_bytes, self.min_block = int(self.head["total_bytes"][0]), int(self.head["min_block"][0])
        self.cuda_index = int(self.head["cuda_index"][0])
        where, self.data_at, expected = layout(self.total_bytes, int(self.head["num_regions"][0]),
                                               self.cuda_index == ON_HOST)
        if expected != size:
            raise StartRefused(f"device pool segment {path} is {size} bytes; its header implies {expected}: "
                               "not trusted")
        for name, kind in REGION_COLUMNS:
            setattr(self, name, np.frombuffer(self.mm, kind, int(self.head["num_regions"][0]), where[name]))
        self.own_pid = os.getpid()
        self._memory: torch.Tensor | None = None   # the pool's bytes, mapped at the first buffer()
        self._allocation: cuda_ipc.Allocation | None = None   # the keeper's own device memory

    @classmethod
    def create(cls, path: Path, lock_path: Path, total_bytes: int, device: str = "cpu") -> "PoolSegment":
        """A new, empty pool at path, replacing a stale one (whoever called holds the daemon's
        instance lock), its bytes on device (a CUDA device: one allocation, exported, that
        lives as long as this process). Made under a temporary name and renamed into place
        whole, so a worker never maps a segment whose header is not written yet."""
        total_bytes = total_bytes // MIN_BLOCK * MIN_BLOCK
        if total_bytes < MIN_BLOCK:
            raise PoolTooSmall(f"device pool of {total_bytes} bytes: below one {MIN_BLOCK}-byte block")
        index = cuda_index(device)
        if index == ON_HOST:
            _check_host_room(path.parent, total_bytes)
        allocation = None if index == ON_HOST else _device_allocation(index, total_bytes)
        staging = path.with_name(path.name + ".new")
        staging.unlink(missing_ok=True)
        try:
            fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, SEGMENT_MODE)
        except (PermissionError, FileExistsError):
            raise UnsafePath(f"device pool segment {staging}: another user's file is in its place and mcpd may "
                             "not replace it; remove it") from None
        try:
            os.fchmod(fd, SEGMENT_MODE)   # whatever the umask
            os.ftruncate(fd, layout(total_bytes, NUM_REGIONS, allocation is None)[2])   # zeros: rows FREE; pages unbacked
            handle = allocation.handle if allocation else bytes(cuda_ipc.HANDLE_BYTES)
            header = np.array([(MAGIC, VERSION, total_bytes, MIN_BLOCK, NUM_REGIONS, os.getpid(), index, handle)],
                              HEADER)
            os.pwrite(fd, header.tobytes(), 0)
        finally:
            os.close(fd)
        os.rename(staging, path)
        segment = cls(path, lock_path)
        segment._allocation = allocation   # a process cannot open its own export: it keeps the pointer
        return segment

    @property
    def keeper_pid(self) -> int:
        return int(self.head["keeper_pid"][0])

    def take(self, kind: int, owner: int, key: bytes, nbytes: int) -> Region:
        """Owner's region of this kind: the one it (or its dead predecessor) holds under the same
        key and size, else a new one (freeing an old one of other contents first)."""
        with self.lock:
            row = self._row_of(kind, owner)
            if row is not None and self.key[row].tobytes() == key and int(self.nbytes[row]) == nbytes:
                return self._take_over(row)
            if row is not None:
                self.state[row] = FREE
            offset = self._allocate(nbytes, kind, owner)
            row = int(np.flatnonzero(self.state == FREE)[0])
            for name, value in (("kind", kind), ("owner", owner), ("pid", self.own_pid), ("offset", offset),
                                ("nbytes", nbytes), ("key", key)):
                getattr(self, name)[row] = value
            self.state[row] = LIVE   # last: until now the row was FREE
            return Region(offset, nbytes, reused=False)

    def release(self, owner: int) -> int:
        """Free every region of owner (a worker removed from the device), to coalesce with their
        free neighbours; returns how many. A region a live process other than the caller holds
        is refused (PoolBusy), all of owner's then kept: memory a worker still writes is never
        handed to another."""
        with self.lock:
            rows = np.flatnonzero((self.state == LIVE) & (self.owner == owner))
            holders = {int(self.pid[r]) for r in rows} - {self.own_pid}
            alive = sorted(pid for pid in holders if process_alive(pid))
            if alive:
                raise PoolBusy(f"worker {owner}'s regions are held by pid {alive[0]}, which still runs: "
                               "stop it before its regions are freed")
            self.state[rows] = FREE
            return len(rows)

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device("cpu") if self.cuda_index == ON_HOST else torch.device("cuda", self.cuda_index)

    def buffer(self, region: Region) -> torch.Tensor:
        """The region's bytes (uint8, on the pool's device), checked to lie inside the pool."""
        if not (0 <= region.offset and region.nbytes > 0 and region.offset + region.nbytes <= self.total_bytes):
            raise ValueError(f"region ({region.offset}, {region.nbytes}) is outside the {self.total_bytes}-byte pool")
        return self._pool_bytes()[region.offset:region.offset + region.nbytes]

    def _pool_bytes(self) -> torch.Tensor:
        import torch   # here, not at the top: the supervisor imports this module (pool_keeper.reclaim)

        if self._memory is None:
            if self._allocation is not None:
                self._memory = self._allocation.tensor()
            elif self.cuda_index == ON_HOST:
                self._memory = torch.frombuffer(self.mm, dtype=torch.uint8, count=self.total_bytes,
                                                offset=self.data_at)
            else:
                self._memory = self._mapped_device_memory()
        return self._memory

    def _mapped_device_memory(self) -> torch.Tensor:
        import torch

        handle = self.head["ipc_handle"][0].tobytes()
        try:
            if not torch.cuda.is_available() or self.cuda_index >= torch.cuda.device_count():
                raise cuda_ipc.CudaError(f"this process sees {torch.cuda.device_count()} CUDA device(s)")
            return cuda_ipc.mapping(handle, self.total_bytes, self.device).tensor()
        except (cuda_ipc.CudaError, RuntimeError) as e:   # RuntimeError: torch's own CUDA errors
            raise StartRefused(f"device pool segment {self.path}: its memory on {self.device} cannot be opened "
                               f"({e})") from None

    def stats(self) -> PoolStats:
        with self.lock:
            allocator = self._allocator()
            rows = np.flatnonzero(self.state == LIVE)
            regions = [PoolRegion(KIND_NAMES.get(int(self.kind[r]), "unknown"), int(self.owner[r]), int(self.pid[r]),
                                  process_alive(int(self.pid[r])), int(self.offset[r]), int(self.nbytes[r]))
                       for r in rows]
        figures = allocator.stats()
        return PoolStats(figures.total_bytes, figures.in_use_bytes, figures.requested_bytes, figures.free_bytes,
                         figures.largest_free_block, round(figures.internal_waste_frac, 6),
                         round(figures.external_fragmentation, 6), sorted(regions, key=lambda r: r.offset))

    def close(self) -> None:
        """Unmap the table (views of the pool's bytes handed out must be gone: the host mapping
        refuses to close under them)."""
        self._memory = None
        for name, _ in REGION_COLUMNS:
            delattr(self, name)
        del self.head
        self.mm.close()

    def _row_of(self, kind: int, owner: int) -> int | None:
        rows = np.flatnonzero((self.state == LIVE) & (self.kind == kind) & (self.owner == owner))
        return int(rows[0]) if len(rows) else None

    def _take_over(self, row: int) -> Region:
        holder = int(self.pid[row])
        if holder != self.own_pid and process_alive(holder):
            raise PoolBusy(f"{KIND_NAMES.get(int(self.kind[row]))} region of worker {int(self.owner[row])} is held "
                           f"by pid {holder}, which still runs")
        self.pid[row] = self.own_pid
        return Region(int(self.offset[row]), int(self.nbytes[row]), reused=True)

    def _allocate(self, nbytes: int, kind: int, owner: int) -> int:
        if not np.any(self.state == FREE):
            raise PoolTooSmall(f"device pool {self.path}: all {len(self.state)} region rows are in use")
        allocator = self._allocator()
        try:
            return allocator.alloc(nbytes)
        except OutOfPoolMemory as e:
            raise PoolTooSmall(
                f"POOL_TOO_SMALL: worker {owner} needs a {KIND_NAMES.get(kind)} region of {nbytes} bytes; the device "
                f"pool has {e.free_bytes} of {self.total_bytes} bytes free, the largest free block {e.largest_free} "
                "bytes: raise pool.bytes (or lower engine.pool_bytes / engine.kv_fraction)") from None

    def _allocator(self) -> RegionAllocator:
        rows = np.flatnonzero(self.state == LIVE)
        return RegionAllocator.restored(self.total_bytes, self.min_block,
                                       {int(self.offset[r]): int(self.nbytes[r]) for r in rows})


def _checked_file(path: Path, fd: int) -> int:
    """The segment's size, if it can be trusted as ours; StartRefused (UnsafePath) if not."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != SEGMENT_MODE:
        raise UnsafePath(f"device pool segment {path}: owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}; "
                         f"expected a regular file of uid {os.geteuid()} with mode {SEGMENT_MODE:o}: not trusted")
    if st.st_size < HEADER.itemsize:
        raise StartRefused(f"device pool segment {path} is {st.st_size} bytes: too short for a header")
    head = np.frombuffer(os.pread(fd, HEADER.itemsize, 0), HEADER)[0]   # before any size is derived from it
    if head["magic"] != MAGIC or head["version"] != VERSION:
        raise StartRefused(f"device pool segment {path} is not an mcpd pool of version {VERSION}: not trusted")
    min_block, regions, index = int(head["min_block"]), int(head["num_regions"]), int(head["cuda_index"])
    if (min_block != MIN_BLOCK or int(head["total_bytes"]) % min_block or not 0 < regions <= NUM_REGIONS
            or not ON_HOST <= index <= MAX_CUDA_INDEX):
        raise StartRefused(f"device pool segment {path}: header fields out of range: not trusted")
    return st.st_size


def _check_host_room(directory: Path, nbytes: int) -> None:
    """A host pool must fit its tmpfs: a sparse file past it is made without complaint and
    kills the first worker that touches a page beyond it (SIGBUS)."""
    st = os.statvfs(directory)
    room = st.f_bavail * st.f_frsize
    if nbytes > room:
        raise StartRefused(f"the device pool of {nbytes} bytes does not fit {directory} ({room} bytes free): "
                           "lower pool.bytes (0: auto)")


def _device_allocation(index: int, nbytes: int) -> cuda_ipc.Allocation:
    """The pool's device memory, zeroed as a new host segment is (the driver does not clear it:
    a worker's region must not show another process's old bytes)."""
    import torch

    device = torch.device("cuda", index)
    try:
        allocation = cuda_ipc.Allocation(device, nbytes)
        allocation.tensor().zero_()
        torch.cuda.synchronize(device)
        return allocation
    except cuda_ipc.CudaError as e:
        raise PoolTooSmall(f"POOL_TOO_SMALL: the device pool of {nbytes} bytes on {device} could not be "
                           f"allocated ({e}): lower pool.bytes") from None
