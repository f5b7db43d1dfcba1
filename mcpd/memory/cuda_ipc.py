"""One device allocation shared between processes through CUDA IPC: the pool keeper makes it and
exports a handle (64 bytes, stored in the pool segment's header); each worker opens the handle
and sees the same device memory, which lives as long as the keeper does, whatever happens to
the workers.

The driver API through ctypes (libcuda.so.1 is wherever a CUDA driver is), not torch's
allocator: torch's caching allocator would round the pool into its own segments and free it
when a tensor dies, while a pool is made once at start and kept. The allocation is outside
torch's accounting on purpose (DESIGN.md: a preallocated pool that the hot path never
allocates from the framework). Each call needs the device's primary context current on the
calling thread, which any torch CUDA call makes so (device_context).

The memory is handed to torch as a uint8 tensor over its pointer (__cuda_array_interface__):
no copy, and the tensor keeps the pointer's owner object alive.
"""
from __future__ import annotations

import ctypes
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # torch is imported where it is used: the pool segment's header needs
    import torch    # HANDLE_BYTES in processes that never load torch (the supervisor)

HANDLE_BYTES = 64   # CUipcMemHandle
LAZY_ENABLE_PEER_ACCESS = 1   # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: the only flag cuIpcOpenMemHandle takes


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's reason."""


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


_driver = None


def _lib() -> ctypes.CDLL:
    global _driver
    if _driver is None:
        try:
            _driver = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaError(f"no CUDA driver (libcuda.so.1): {e}") from None
    return _driver


def _check(result: int, call: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _lib().cuGetErrorString(result, ctypes.byref(text))
        reason = text.value.decode() if text.value else "unknown error"
        raise CudaError(f"{call} failed: CUDA error {result} ({reason})")


def device_context(device: torch.device) -> None:
    """Make the device's primary context current on this thread (torch initialises it)."""
    import torch

    torch.cuda.set_device(device)
    torch.cuda.current_stream(device).synchronize()   # a runtime call: the context exists and is current


class Allocation:
    """Device memory this process allocated, with its IPC handle; the driver frees it when the
    process ends (a pool lives as long as its keeper)."""

    def __init__(self, device: torch.device, nbytes: int):
        device_context(device)
        self.device, self.nbytes, self.pointer = device, nbytes, ctypes.c_uint64()
        _check(_lib().cuMemAlloc_v2(ctypes.byref(self.pointer), ctypes.c_size_t(nbytes)),
               f"cuMemAlloc({nbytes} bytes on {device})")
        handle = _Handle()
        _check(_lib().cuIpcGetMemHandle(ctypes.byref(handle), self.pointer), "cuIpcGetMemHandle")
        self.handle = bytes(handle)   # all 64 bytes (.reserved would stop at a NUL)

    def tensor(self) -> torch.Tensor:
        return _as_tensor(self, self.pointer.value, self.nbytes, self.device)


_open: "weakref.WeakValueDictionary[bytes, Mapping]" = weakref.WeakValueDictionary()


def mapping(handle: bytes, nbytes: int, device: torch.device) -> "Mapping":
    """The allocation behind handle, opened once per process (the driver maps a handle once
    per context: a second cuIpcOpenMemHandle of it fails), shared by every segment object."""
    opened = _open.get(handle)
    if opened is None or opened.nbytes != nbytes:
        opened = _open[handle] = Mapping(handle, nbytes, device)
    return opened


class Mapping:
    """Another process's allocation opened from its handle (use mapping()); closed when no
    tensor over it is left."""

    def __init__(self, handle: bytes, nbytes: int, device: torch.device):
        if len(handle) != HANDLE_BYTES:
            raise CudaError(f"an IPC handle is {HANDLE_BYTES} bytes, not {len(handle)}")
        device_context(device)
        self.pointer = ctypes.c_uint64()
        _check(_lib().cuIpcOpenMemHandle_v2(ctypes.byref(self.pointer), _Handle.from_buffer_copy(handle), LAZY_ENABLE_PEER_ACCESS),
               "cuIpcOpenMemHandle (is the pool keeper alive?)")
        self.nbytes, self.device = nbytes, device

    def tensor(self) -> torch.Tensor:
        return _as_tensor(self, self.pointer.value, self.nbytes, self.device)

    def __del__(self):
        if _driver is not None and self.pointer.value:
            _driver.cuIpcCloseMemHandle(self.pointer)


class _Span:
    """A pointer torch can wrap; held by the tensor, it holds the allocation or mapping."""

    def __init__(self, owner, pointer: int, nbytes: int):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False),
                                         "strides": None, "version": 2}


def _as_tensor(owner, pointer: int, nbytes: int, device: torch.device) -> torch.Tensor:
    import torch

    tensor = torch.as_tensor(_Span(owner, pointer, nbytes), device=device)
    if tensor.data_ptr() != pointer:
        raise CudaError("torch copied the device pool instead of viewing it")
    return tensor
