"""A device pool kept for a test, as the daemon's pool keeper keeps one: on the CPU made in this
process; on a GPU by a keeper process of its own, since CUDA IPC shares memory between
processes only (a process cannot open its own export) and the pool must outlive the engines
the test starts and drops."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from mcpd.memory import pool_segment
from mcpd.memory.pool_segment import PoolSegment

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])   # CI has no GPU: its cases skip there

KEEPER = """
import sys
from pathlib import Path
from mcpd.memory.pool_segment import PoolSegment
PoolSegment.create(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
print("kept", flush=True)
sys.stdin.read()   # until the test closes our stdin
"""


class KeptPool:
    def __init__(self, runtime_dir: Path, device: str, nbytes: int):
        self.device = torch.device(device)
        self.path = pool_segment.segment_path(runtime_dir, device)
        self.lock = pool_segment.lock_path(runtime_dir, device)
        self.keeper = None
        if self.device.type == "cpu":
            PoolSegment.create(self.path, self.lock, nbytes)
        else:
            self.keeper = subprocess.Popen([sys.executable, "-c", KEEPER, str(self.path), str(self.lock), str(nbytes),
                                            device], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            assert self.keeper.stdout.readline() == b"kept\n", "the test's pool keeper did not start"

    def __call__(self) -> PoolSegment:
        """A mapping of the pool, as each worker has its own."""
        return PoolSegment(self.path, self.lock)

    def close(self) -> None:
        if self.keeper is not None:
            self.keeper.stdin.close()
            self.keeper.wait(30)
        self.path.unlink(missing_ok=True)

