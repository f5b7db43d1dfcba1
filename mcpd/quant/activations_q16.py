"""Activations as the 4-bit products take them (kernels.c, x_q16): each row in blocks of 32
columns, q = round(x / d) to int16 (ties to even), d = max |x| / 32767. The native kernels
multiply q by the weights' integers and scale each block's sum once; the torch twin multiplies
d * q, the same values, by the dequantized weights."""
from __future__ import annotations

import torch

from mcpd.quant.int4_layout import BLOCK

LIMIT = 32767   # |q| at most: a block's largest |x| maps to it


def quantized(x: torch.Tensor) -> torch.Tensor:
    """float32 d * q of x [..., k] (k a multiple of BLOCK), in the same float32 steps as kernels.c's
    x_q16_quantize, so both round each value alike."""
    blocks = x.float().unflatten(-1, (-1, BLOCK))
    d = blocks.abs().amax(dim=-1, keepdim=True) / LIMIT
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return ((blocks * inverse).round() * d).flatten(-2)
