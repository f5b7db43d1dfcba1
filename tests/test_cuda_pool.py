"""The device pool on a GPU: one allocation the keeper exports through CUDA IPC, which worker
processes open, write and die in, and which keeps what they wrote. The GPU cases run where a
GPU is (skipped in CI, which has none); the header's device field is checked everywhere."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from mcpd.memory import pool_segment
from mcpd.memory.pool_segment import KV, PoolSegment
from mcpd.refusal import StartRefused
from pool_keeping import KeptPool

MIB = 1 << 20
KEY = b"k" * 32
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")

WORKER = """
import os, signal, sys, torch
from pathlib import Path
from mcpd.memory.pool_segment import KV, PoolSegment
segment = PoolSegment(Path(sys.argv[1]), Path(sys.argv[2]))
region = segment.take(KV, 0, b"k" * 32, 1 << 20)
memory = segment.buffer(region)
print(int(region.reused), int(memory[:4].sum()), flush=True)
memory.fill_(int(sys.argv[3]))
torch.cuda.synchronize()
os.kill(os.getpid(), signal.SIGKILL)   # a worker dying with its region written
"""


def run_worker(pool: KeptPool, fill: int) -> list[int]:
    """A worker process that takes worker 0's KV region, reports (reused, sum of its first 4
    bytes), fills the region with `fill` and is SIGKILLed."""
    done = subprocess.run([sys.executable, "-c", WORKER, str(pool.path), str(pool.lock), str(fill)],
                          capture_output=True, timeout=120)
    assert done.returncode == -9, done.stderr.decode()
    return [int(x) for x in done.stdout.split()]


@cuda
def test_a_killed_workers_region_keeps_its_bytes_for_the_next(tmp_path):
    pool = KeptPool(tmp_path, "cuda", 64 * MIB)
    try:
        assert run_worker(pool, 7) == [0, 0]          # a fresh region: the keeper zeroed the pool
        assert run_worker(pool, 9) == [1, 4 * 7]
        assert run_worker(pool, 1) == [1, 4 * 9]
        segment = pool()
        [row] = segment.stats().regions
        assert row.kind == "kv" and not row.pid_alive
        assert segment.device == torch.device("cuda", 0) and os.path.getsize(pool.path) < MIB   # no pool bytes on the host
    finally:
        pool.close()


@cuda
def test_a_view_on_the_gpu_stays_inside_the_pool(tmp_path):
    pool = KeptPool(tmp_path, "cuda", 4 * MIB)
    try:
        segment = pool()
        region = segment.take(KV, 1, KEY, MIB)
        assert segment.buffer(region).is_cuda and segment.buffer(region).numel() == MIB
        with pytest.raises(ValueError, match="outside"):
            segment.buffer(pool_segment.Region(3 * MIB, 2 * MIB, False))
    finally:
        pool.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_gpu_pool_on_a_machine_without_one_is_refused_not_crashed_on(tmp_path):
    path, lock = pool_segment.segment_path(tmp_path, "cpu"), pool_segment.lock_path(tmp_path, "cpu")
    PoolSegment.create(path, lock, 4 * MIB)
    try:
        header = np.frombuffer(bytearray(path.read_bytes()[:pool_segment.HEADER.itemsize]), pool_segment.HEADER).copy()
        header["cuda_index"] = 0
        with open(path, "r+b") as f:
            f.write(header.tobytes())
            f.truncate(pool_segment.layout(4 * MIB, pool_segment.NUM_REGIONS, on_host=False)[2])
        segment = PoolSegment(path, lock)
        region = segment.take(KV, 0, KEY, MIB)
        with pytest.raises(StartRefused, match="cannot be opened"):
            segment.buffer(region)
    finally:
        path.unlink(missing_ok=True)


def test_a_header_naming_an_impossible_device_is_not_trusted(tmp_path):
    path, lock = pool_segment.segment_path(tmp_path, "cpu"), pool_segment.lock_path(tmp_path, "cpu")
    PoolSegment.create(path, lock, 4 * MIB)
    try:
        header = np.frombuffer(bytearray(path.read_bytes()[:pool_segment.HEADER.itemsize]), pool_segment.HEADER).copy()
        for index in (-2, pool_segment.MAX_CUDA_INDEX + 1):
            header["cuda_index"] = index
            with open(path, "r+b") as f:
                f.write(header.tobytes())
            with pytest.raises(StartRefused, match="out of range"):
                PoolSegment(path, lock)
        header["cuda_index"] = 0   # a GPU pool's segment holds no pool bytes: this one's size is wrong
        with open(path, "r+b") as f:
            f.write(header.tobytes())
        with pytest.raises(StartRefused, match="header implies"):
            PoolSegment(path, lock)
    finally:
        path.unlink(missing_ok=True)
