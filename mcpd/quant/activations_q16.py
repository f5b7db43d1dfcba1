"""Activations as the integer products take them: each row of x (int8 weights: kernels.c's
x_int16_rows) or each block of 32 columns of it (4-bit weights: x_q16_quantize) rounded to
int16, q = round(x * (32767 / max |x|)) (ties to even), with the scale max |x| / 32767. The
native kernels multiply q by the weights' integers and scale each sum once; the torch twins
multiply the same values by the dequantized weights."""
from __future__ import annotations

import torch

from mcpd.quant.int4_layout import BLOCK

INT16_LEVELS = 32767   # |q| at most: the largest |x| maps to it


def int16_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row of x rounded to int16 levels, as float32 [..., k]; its float32 scale [..., 1]),
    operation for operation as kernels.c rounds them, so both give the same values. A row of
    zeros: scale 0; a NaN in a row: its scale NaN."""
    most = x.float().abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(most > 0, INT16_LEVELS / most, torch.zeros_like(most))
    return torch.round(x.float() * inverse), most / INT16_LEVELS


def quantized(x: torch.Tensor) -> torch.Tensor:
    """float32 scale * q of x [..., k] (k a multiple of BLOCK), each block of BLOCK columns rounded
    as int16_rows rounds a row: the values the 4-bit products take."""
    levels, scale = int16_rows(x.unflatten(-1, (-1, BLOCK)))
    return (levels * scale).flatten(-2)
