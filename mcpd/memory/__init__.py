"""Device and host memory management: a buddy allocator over offsets and the device pool it runs.

DevicePool is imported lazily so that processes which only need the allocator (the host
shared-memory cache, the front-end) do not pay for importing torch.
"""
from mcpd.memory.buddy import AllocatorError, AllocatorStats, BuddyAllocator, OutOfPoolMemory

__all__ = ["AllocatorError", "AllocatorStats", "BuddyAllocator", "DevicePool", "OutOfPoolMemory"]


def __getattr__(name: str):
    if name == "DevicePool":
        from mcpd.memory.pool import DevicePool

        return DevicePool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
