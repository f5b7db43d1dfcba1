"""KV blocks through the host shared-memory tier (engine/host_kv.py) on their own: a block saved
from a device cache comes back byte for byte into another block, from a CPU cache directly and
from a CUDA one through the pinned buffer (on a GPU: CI has none)."""
import hashlib
import uuid
from pathlib import Path

import pytest
import torch

from mcpd.engine.host_kv import HostKV
from mcpd.memory.host_segment import KV_BLOCK
from mcpd.memory.shm_arena import ShmArena
from mcpd.memory.shm_layout import Layout

PAGE = 4096
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="no CUDA device here (CI has none)"))]


@pytest.fixture
def arena(tmp_path):
    path = Path("/dev/shm") / f"mcpd-test-{uuid.uuid4().hex[:12]}"
    yield ShmArena.create(path, tmp_path / "cache.lock", Layout(64, 64, PAGE).size, PAGE, None, 64)
    path.unlink(missing_ok=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_saved_block_comes_back_byte_for_byte_into_another_block(arena, device, dtype):
    cache = torch.randn(4, 2, 2, 16, 2, 8, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    host = HostKV(arena)
    key = hashlib.blake2b(b"block", digest_size=32).digest()
    host.save(key, cache[1])
    assert host.saved == 1 and (host.staging is not None) == (device == "cuda")
    host.place(key, host.fetch(key, cache[1].nbytes), cache[3])
    assert host.loaded == 1 and torch.equal(cache[3].view(torch.uint8), cache[1].view(torch.uint8))
    other = torch.zeros_like(cache[0])
    HostKV(arena).place(key, arena.get(KV_BLOCK, key), other)   # another worker's view of the arena
    assert torch.equal(other.cpu(), cache[1].cpu())


def test_an_entry_of_another_size_is_a_miss_never_spread_over_a_block(arena):
    """A one-byte entry under a block's key would fill a whole block by broadcasting if placed."""
    host = HostKV(arena)
    key = hashlib.blake2b(b"short", digest_size=32).digest()
    arena.put(KV_BLOCK, key, [torch.ones(1, dtype=torch.uint8).numpy()])
    assert host.fetch(key, 4096) is None and host.fetch(key, 1) is not None
