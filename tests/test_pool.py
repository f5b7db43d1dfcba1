"""DevicePool: typed views into one preallocated tensor. Runs on the CPU; the CUDA case runs where
a GPU is present."""
from __future__ import annotations

import types

import pytest
import torch

from mcpd.memory import AllocatorError, DevicePool, OutOfPoolMemory
from mcpd.memory import pool_size
from mcpd.refusal import StartRefused

MIB = 1 << 20
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def inside_pool(pool: DevicePool, view: torch.Tensor) -> bool:
    start = pool.tensor.data_ptr()
    return start <= view.data_ptr() and view.data_ptr() + view.nbytes <= start + pool.nbytes


@pytest.mark.parametrize("device", DEVICES)
def test_views_have_the_requested_shape_and_dtype(device: str) -> None:
    pool = DevicePool(MIB, device)
    assert pool.tensor.dtype == torch.uint8 and pool.tensor.numel() == MIB
    assert pool.device.type == device and pool.allocator.total_bytes == pool.nbytes == MIB
    for shape, dtype in [((3, 5), torch.float16), ((2, 16, 7), torch.float32), ((9,), torch.int64),
                         ((4, 4), torch.bfloat16), ((1,), torch.bool)]:
        offset, view = pool.alloc(shape, dtype)
        assert view.shape == shape and view.dtype == dtype and view.device == pool.device
        assert view.is_contiguous()
        # A view, not a copy: same storage as the pool, at the allocator's offset.
        assert view.untyped_storage().data_ptr() == pool.tensor.untyped_storage().data_ptr()
        assert view.data_ptr() == pool.tensor.data_ptr() + offset
        assert inside_pool(pool, view)


@pytest.mark.parametrize("device", DEVICES)
def test_writes_through_views_never_clobber_each_other(device: str) -> None:
    pool = DevicePool(MIB, device)
    dtypes = [torch.float32, torch.float16, torch.int32, torch.uint8, torch.bfloat16]
    views = [pool.alloc((13, 11 + i), dtypes[i % len(dtypes)]) for i in range(40)]
    for value, (_, view) in enumerate(views):
        view.fill_(value % 100 + 1)
    for value, (_, view) in enumerate(views):
        assert torch.all(view == value % 100 + 1), f"view {value} was overwritten"
    # Writing the pool bytes through a view shows up in the pool tensor itself.
    offset, view = views[0]
    assert torch.all(pool.tensor[offset : offset + view.nbytes].view(view.dtype) == 1)


def test_free_then_realloc_reuses_the_memory() -> None:
    pool = DevicePool(MIB, "cpu")
    offset, _ = pool.alloc((MIB // 4,), torch.float32)  # the whole pool
    with pytest.raises(OutOfPoolMemory):
        pool.alloc((1,), torch.uint8)
    pool.free(offset)
    assert pool.stats().free_bytes == MIB
    again, view = pool.alloc((MIB // 8,), torch.float64)
    assert again == offset and view.numel() == MIB // 8
    with pytest.raises(AllocatorError):
        pool.free(again + 256)


def test_stats_track_the_allocator() -> None:
    pool = DevicePool(MIB, "cpu")
    pool.alloc((100,), torch.float16)  # 200 bytes, granted one 256-byte block
    stats = pool.stats()
    assert (stats.requested_bytes, stats.in_use_bytes, stats.live_allocations) == (200, 256, 1)


def test_empty_shape_rejected() -> None:
    pool = DevicePool(MIB, "cpu")
    with pytest.raises(AllocatorError, match="at least one element"):
        pool.alloc((4, 0), torch.float32)


def test_resolve_bytes_counts_bytes_and_rounds_down_to_mib() -> None:
    assert pool_size.resolve_bytes(256 * MIB, "cpu") == 256 * MIB
    assert pool_size.resolve_bytes(3.5 * MIB + 17, "cpu") == 3 * MIB
    with pytest.raises(ValueError, match="below 1 MiB"):
        pool_size.resolve_bytes(MIB - 1, "cpu")
    for bad in (0, -5):
        with pytest.raises(ValueError, match="pool_bytes"):
            pool_size.resolve_bytes(bad, "cpu")


@pytest.mark.parametrize("pool_bytes", [2 ** 63, 1e300])
def test_resolve_bytes_refuses_more_than_the_device_has(pool_bytes) -> None:
    with pytest.raises(StartRefused, match="more than the .* bytes of memory cpu has"):
        pool_size.resolve_bytes(pool_bytes, "cpu")


def test_resolve_bytes_fraction_of_available_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    available = 10 * MIB + 12345
    monkeypatch.setattr(pool_size.psutil, "virtual_memory",
                        lambda: types.SimpleNamespace(available=available))
    assert pool_size.resolve_bytes(0.5, "cpu") == 5 * MIB
    assert pool_size.resolve_bytes(1, "cpu") == 10 * MIB


def test_resolve_bytes_fraction_of_free_cuda_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # Runs without a GPU: the CUDA queries are stood in for.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 * MIB + 5, 80 * MIB))
    assert pool_size.resolve_bytes(0.25, "cuda:0") == 2 * MIB


def test_cuda_without_cuda_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        DevicePool(MIB, "cuda")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        pool_size.resolve_bytes(0.5, "cuda:0")


def test_unsupported_device_rejected() -> None:
    with pytest.raises(ValueError, match="cuda and cpu only"):
        DevicePool(MIB, "meta")


def test_reserved_front_region_stays_outside_the_buddy():
    import torch
    from mcpd.memory import AllocatorError, DevicePool
    pool = DevicePool(96 << 20, "cpu", reserved_bytes=(86 << 20) + 1)   # not a power of two
    front = pool.reserved_view(((86 << 20) // 4,), torch.float32)
    offset, view = pool.alloc((1024,), torch.float32)
    assert offset >= pool.reserved_bytes >= 86 << 20
    front.fill_(1.0)
    view.fill_(2.0)
    assert float(front.max()) == 1.0 and float(view.min()) == 2.0
    assert pool.stats().total_bytes == (96 << 20) - pool.reserved_bytes
    with pytest.raises(AllocatorError):
        pool.free(0)
    with pytest.raises(AllocatorError):
        pool.reserved_view((pool.reserved_bytes + 1,), torch.uint8)
    pool.free(offset)
