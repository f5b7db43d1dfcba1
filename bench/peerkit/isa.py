"""`--isa avx2`: an AVX-512 machine standing in for an AVX2-only one as far as software can
(bench/peers.py, bench/gguf_quantized.py). mcpd runs its AVX2 kernels, and the benchmark's
processes start with torch's, oneDNN's and MKL's instruction sets capped at AVX2. llama.cpp has no
such switch: it runs from a build of its own without AVX-512 (bench/peerkit/llamacpp_avx2.py).
No torch here: the caps must be set before torch loads.
"""
from __future__ import annotations

import os
import sys

from mcpd.cpu import features

CHOICES = ("native", "avx2")
# What caps torch (ATen's own kernels), oneDNN and MKL at AVX2; read when each library loads.
CAP_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def cap(isa: str) -> None:
    """For avx2, runs this script again with CAP_ENV set, unless it is: torch reads it at import."""
    if isa == "avx2" and any(os.environ.get(name) != value for name, value in CAP_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **CAP_ENV})


def mcpd_kernels(isa: str) -> str:
    """engine.kernels for the run: the AVX2 set, or the best the CPU has."""
    return "native-avx2" if isa == "avx2" else "auto"


def described(isa: str) -> str:
    """The instruction sets the run had: the CPU's, or AVX2 with AVX-512 masked."""
    native = "AVX-512" if features.has("avx512f") else "AVX2" if features.has("avx2") else "neither AVX2 nor AVX-512"
    if isa == "avx2" and native == "AVX-512":
        return "AVX2 (AVX-512 masked for mcpd, torch, oneDNN and MKL; llama.cpp built without it)"
    return native
