"""Which kernel set runs a model (engine.kernels = auto, native, native-<isa> or torch), and why, for the log."""
from __future__ import annotations

import torch

from mcpd.kernels import native
from mcpd.kernels.native_kernels import NativeKernels
from mcpd.kernels.torch_kernels import TORCH, TorchKernels


def choose(requested: str, dtype: torch.dtype, device: torch.device, sizes: list[int], head_dim: int,
           group: int) -> tuple[TorchKernels, str]:
    """The kernels for engine.kernels = requested (auto, native, native-<isa>, torch), and why,
    for the log. auto and native take the native kernels of the best instruction set this CPU
    runs (native.ISAS), native-<isa> those of that one; auto falls back to torch where they do not
    support the model or build here, the others refuse (NativeUnavailable)."""
    if requested == "torch":
        return TORCH, "engine.kernels = torch"
    if requested == "auto" and device.type == "cuda":
        return _cuda_kernels()
    isa = requested.removeprefix("native-") if requested.startswith("native-") else native.best_isa()
    if isa is None:
        reason = "torch kernels (the native ones want AVX2 + FMA or AVX-512; this CPU has neither)"
        if requested != "auto":
            raise native.NativeUnavailable(reason)
        return TORCH, reason
    if not NativeKernels.supports(dtype, device, sizes, head_dim, group):
        reason = f"native kernels do not support {dtype} on {device.type} with these sizes"
        if requested != "auto":
            raise native.NativeUnavailable(reason)
        return TORCH, reason
    try:
        return NativeKernels(isa), f"native kernels ({isa})"
    except (native.NativeUnavailable, OSError) as e:
        if requested != "auto":
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
    if requested.startswith("native"):
        raise native.NativeUnavailable(f"the native kernels have no {feature} (engine.kernels = {requested})")
    return TORCH, f"torch kernels (the native and CUDA ones have no {feature})"
