"""4-bit weights as GGUF's Q4_0 and Q4_1 blocks hold them, kept so in memory (half a byte a
weight, and a float16 scale, for Q4_1 a min too, a block of 32: the file's own size).

    w[n, 32b + i] = d[n, b] * q + m[n, b],  q the low nibble of values[n, 16b + i] (i < 16),
                                            the high one of values[n, 16b + i - 16] (i >= 16)

Q4_1 stores d and m; Q4_0 stores d with q - 8, which is m = -8 d, not stored (exact: d * q and
8 d are float16 values times small integers). d * q is exact in float32, so every kernel's weights are
those the gguf package's dequantize gives, bit for bit (tests/test_int4.py).

The torch twin multiplies by the dequantized weight a panel of rows at a time, never the whole
matrix (it would be eight times the weights' memory); the native kernels (kernels.c, tile_int4)
dequantize in registers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mcpd.quant.int4_layout import BLOCK, MINS_SUFFIX, SCALES_SUFFIX, shapes

ROWS_AT_ONCE = 256   # rows the torch twin dequantizes at once: 512 KB of float32 at 512 columns


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """A weight matrix as the torch kernels multiply it: values uint8 [n, k/2], scales and mins
    float16 [n, k/32] (mins None: Q4_0's, -8 scales)."""
    values: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.values.shape[0], self.values.shape[1] * 2


def dequantize(w: Int4Weight, rows: slice = slice(None)) -> torch.Tensor:
    """float32 [rows, k]: the weights w's rows stand for."""
    values = w.values[rows]
    n, blocks = values.shape[0], w.scales.shape[1]
    packed = values.view(n, blocks, BLOCK // 2)
    q = torch.cat((packed & 15, packed >> 4), dim=2).float()
    scales = w.scales[rows].float()[:, :, None]
    mins = scales * -8 if w.mins is None else w.mins[rows].float()[:, :, None]
    return (q * scales + mins).view(n, blocks * BLOCK)


def linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x . w^T (+ bias) in x's dtype, multiplied in float32 by the dequantized weights,
    ROWS_AT_ONCE output rows at a time."""
    n = w.shape[0]
    x32 = x.float()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32, device=x.device)
    for start in range(0, n, ROWS_AT_ONCE):
        rows = slice(start, min(start + ROWS_AT_ONCE, n))
        y[..., rows] = x32 @ dequantize(w, rows).T
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def rows(ids: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """float32 [len(ids), k]: the rows ids of the matrix (an embedding table's)."""
    return dequantize(Int4Weight(w.values[ids], w.scales[ids], None if w.mins is None else w.mins[ids]))


def hold_int4(module: nn.Module, with_mins: bool) -> None:
    """Give module (a linear layer or an embedding, its memory allocated, not yet filled) 4-bit
    weights: its weight becomes the bytes, beside it the scales and where with_mins the mins
    (int4_layout)."""
    rows, columns = module.weight.shape
    device = module.weight.device
    values, blocks = shapes(rows, columns)
    module.weight = nn.Parameter(torch.empty(values, dtype=torch.uint8, device=device), requires_grad=False)
    for suffix in (SCALES_SUFFIX, MINS_SUFFIX)[:2 if with_mins else 1]:
        module.register_parameter("weight" + suffix, nn.Parameter(
            torch.empty(blocks, dtype=torch.float16, device=device), requires_grad=False))

