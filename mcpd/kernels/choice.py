"""Which kernel set runs a model (engine.kernels = auto, native or torch), and why, for the log."""
from __future__ import annotations

import torch

from mcpd.cpu import features
from mcpd.kernels import native
from mcpd.kernels.native_kernels import NativeKernels
from mcpd.kernels.torch_kernels import TORCH, TorchKernels


def choose(requested: str, dtype: torch.dtype, device: torch.device, sizes: list[int], head_dim: int,
           group: int) -> tuple[TorchKernels, str]:
    """The kernels for engine.kernels = requested (auto, native, torch), and why, for the log.
    auto takes native where it supports the model, builds here and the CPU has AVX-512, else
    torch; native refuses (NativeUnavailable) where it cannot run."""
    if requested == "torch":
        return TORCH, "engine.kernels = torch"
    if requested == "auto" and device.type == "cuda":
        return _cuda_kernels()
    if requested == "auto" and device.type == "cpu" and not features.has("avx512f"):
        # The product tiles hold their sums in 32 AVX-512 registers; with AVX2's 16 they spill:
        # on an AVX2 EPYC a 128-token prefill took 1.5 s against torch's (MKL) 0.14 s, and batched
        # decode was as slow, for 12% more batch-1 decode. bench/engine.py --kernels native shows it.
        return TORCH, "torch kernels (the native ones want AVX-512; this CPU has none)"
    if not NativeKernels.supports(dtype, device, sizes, head_dim, group):
        reason = f"native kernels do not support {dtype} on {device.type} with these sizes"
        if requested == "native":
            raise native.NativeUnavailable(reason)
        return TORCH, reason
    try:
        return NativeKernels(), "native kernels"
    except (native.NativeUnavailable, OSError) as e:
        if requested == "native":
            raise native.NativeUnavailable(str(e)) from None
        return TORCH, f"native kernels unavailable ({e})"


def _cuda_kernels() -> tuple[TorchKernels, str]:
    """On a CUDA device: torch's kernels with the paged decode attention in Triton (cuda_kernels.py);
    torch's alone where Triton is missing (it comes with torch's CUDA builds, not every install)."""
    try:
        from mcpd.kernels.cuda_kernels import CudaKernels
    except ImportError as e:
        return TORCH, f"torch kernels (no Triton for the CUDA ones: {e})"
    return CudaKernels(), "cuda kernels (torch's products, fused layer ops and paged decode attention in Triton)"


def torch_for(requested: str, feature: str) -> tuple[TorchKernels, str]:
    """torch's kernels for a model with a feature only they run; NativeUnavailable where
    engine.kernels = native asks for the native ones."""
    if requested == "native":
        raise native.NativeUnavailable(f"the native kernels have no {feature} (engine.kernels = native)")
    return TORCH, f"torch kernels (the native and CUDA ones have no {feature})"
