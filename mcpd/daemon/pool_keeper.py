"""The pool keeper: one process per device that makes the device's pool (pool_segment.py; on a
GPU one device allocation exported through CUDA IPC) once at start and keeps it for the
daemon's life, so the regions workers take from it (their KV
caches) outlive the workers. It computes nothing: it reports the pool and its regions for
`mcpctl status`, and removes the segment when stopped.

A keeper that dies takes its device's workers with it (the supervisor kills them): its successor
makes a fresh segment, and a worker must never go on writing into a pool nobody keeps, nor two
workers of one device map different pools. Workers wait for the segment of a live keeper
(pool_segment.attach_when_kept), so the start order does not matter.

`run` is the process: it owns the segment and the events socket; what it reports, and when, is
keeper_core.py's.
"""
from __future__ import annotations

import os
import time

import zmq

from mcpd.config import Config
from mcpd.daemon import child
from mcpd.daemon.keeper_core import KeeperCore
from mcpd.memory import pool_segment
from mcpd.memory.pool_segment import PoolSegment
from mcpd.refusal import StartRefused

AUTO_HEADROOM = 17 / 16   # pool.bytes = 0: each worker's share plus room for its KV records and alignment


def shared_pool_devices(config: Config, devices: list[str]) -> list[str]:
    """The devices whose workers share a pool kept by a pool keeper: all of them, unless
    pool.shared is off (then each worker keeps a private pool that dies with it)."""
    return list(dict.fromkeys(devices)) if config.pool.shared else []


def pool_bytes(config: Config, device: str, workers: int) -> int:
    """The device pool's size from pool.bytes (0: auto: per worker, its engine.pool_bytes share
    with headroom, and its model version's parameters: [models] may give each worker another).
    Without torch for the CPU (pool_size.py, parameter_table.py)."""
    # Here: the supervisor imports this module (reclaim), and would load psutil for nothing.
    from mcpd.memory import pool_size
    from mcpd.models.architecture import UnsupportedModel
    from mcpd.models.parameter_table import parameter_bytes

    if config.pool.bytes:
        return pool_size.resolve_bytes(config.pool.bytes, device)
    share = pool_size.resolve_bytes(config.engine.pool_bytes, device) * AUTO_HEADROOM
    models = ([config.models[m].versions[v] for m, v in config.worker_versions()[:workers]] if config.models
              else [config.model] * workers)
    try:
        return int(sum(share + parameter_bytes(model, device) for model in models))
    except UnsupportedModel as e:   # restarting would meet the same file: refuse, with its reason
        raise StartRefused(f"model: {e}") from None


def reclaim(config: Config, device: str, owner: int) -> int:
    """Give worker `owner`'s regions on `device` (its weights and KV) back to the device's
    pool, where they coalesce with their free neighbours: for a worker index that is removed (its
    model version unloaded, fewer workers). Call it once the worker's process, and any standby
    of it, is gone (joined): a region a live process holds is refused (PoolBusy) and kept.
    Returns how many regions were freed; 0 where the device has no shared pool (a private pool
    went with its worker) or none is kept now (a keeper's successor makes a fresh one)."""
    path = pool_segment.segment_path(config.runtime_dir, device)
    if device not in shared_pool_devices(config, [device]) or not os.path.lexists(path):
        return 0
    segment = PoolSegment(path, pool_segment.lock_path(config.runtime_dir, device))
    try:
        return segment.release(owner)
    finally:
        segment.close()


def run(config: Config, index: int, device: str, workers: int) -> None:
    log = child.start(f"keeper{index}", config)
    path = pool_segment.segment_path(config.runtime_dir, device)
    try:
        segment = PoolSegment.create(path, pool_segment.lock_path(config.runtime_dir, device),
                                     pool_bytes(config, device, workers), device)
    except StartRefused as e:
        child.refuse_start(config, "keeper", e, index)
    child.exit_on_sigterm(lambda: path.unlink(missing_ok=True))
    log.info("device pool for %s: %d bytes at %s, for %d worker(s)", device, segment.total_bytes, path, workers)
    events = child.EventReporter(zmq.Context(), config, "keeper", index)
    core = KeeperCore(device, str(path), config.supervisor.stats_interval_s, events, segment.stats)
    core.start()
    parent_pid = os.getppid()
    while (wait := core.tick(time.monotonic(), child.parent_alive(parent_pid))) is not None:
        time.sleep(wait)
