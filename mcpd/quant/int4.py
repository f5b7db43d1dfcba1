"""4-bit weights as GGUF's Q4_0, Q4_1 and Q4_K blocks hold them, kept so in memory (half a byte a
weight, and a float16 scale, for Q4_1 a min too, a block of 32: the file's own size; Q4_K a byte
each for its 6-bit scale and min, and a float16 d and dmin a super-block of 256: 1.03x the file);
and Q6_K's 6-bit weights as 4-bit ones with their top two bits beside (highs), int8 scales of 16
columns and a float16 d a super-block: w = (d * scale) * (q - 32), the file's own size.

    w[n, 32b + i] = d[n, b] * q + m[n, b],  q the low nibble of values[n, 16b + i] (i < 16),
                                            the high one of values[n, 16b + i - 16] (i >= 16)

Q4_1 stores d and m; Q4_0 stores d with q - 8, which is m = -8 d, not stored (exact: d * q and
8 d are float16 values times small integers). Q4_K's block scale is d * sc and its min -dmin * m
(sc, m its 6-bit integers, d, dmin its super-block's float16s): exact in float32 too, so
w = (d * sc) * q - dmin * m rounds once, as Q4_1's does. d * q is exact in float32, so every
kernel's weights are those the gguf package's dequantize gives, bit for bit (tests/test_int4.py).
Q6_K's d * scale is exact too, and its product with q - 32 rounds once, as the gguf package's.
Q4_K's and Q6_K's nibbles are reordered at load into Q4_1's order (gguf_blocks.py), so one
kernel reads them all.

Products take x quantized to int16 in blocks of 32 (activations_q16.py). The
torch twin multiplies those values by the dequantized weight a panel of rows at a time, never the
whole matrix (it would be eight times the weights' memory); the native kernels (kernels.c,
rows_int4) multiply the integers and scale each block's sum once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mcpd.quant import activations_q16
from mcpd.quant.int4_layout import BLOCK, Q6_GROUP, SUPER_BLOCK, pieces

ROWS_AT_ONCE = 256   # rows the torch twin dequantizes at once: 512 KB of float32 at 512 columns


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """A weight matrix as the torch kernels multiply it: values uint8 [n, k/2], scales and mins
    float16 [n, k/32] (mins None: Q4_0's, -8 scales); or, Q4_K's, scales and mins uint8 [n, k/32]
    (sc, m) and supers float16 [n, k/256, 2] (d, dmin); or, Q6_K's, scales int8 [n, k/16],
    highs uint8 [n, k/4] (int4_layout) and supers float16 [n, k/256, 1] (d)."""
    values: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    supers: torch.Tensor | None = None
    highs: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.values.shape[0], self.values.shape[1] * 2


def dequantize(w: Int4Weight, rows: slice = slice(None)) -> torch.Tensor:
    """float32 [rows, k]: the weights w's rows stand for."""
    values = w.values[rows]
    n, blocks = values.shape[0], values.shape[1] // (BLOCK // 2)
    packed = values.view(n, blocks, BLOCK // 2)
    q = torch.cat((packed & 15, packed >> 4), dim=2).float()
    if w.highs is not None:
        return _six_bit(w, rows, q)
    scales, mins = block_scales(w, rows)
    return (q * scales[:, :, None] + mins[:, :, None]).view(n, blocks * BLOCK)


def _six_bit(w: Int4Weight, rows: slice, low: torch.Tensor) -> torch.Tensor:
    """Q6_K's weights [rows, k] from their low nibbles [rows, k/32, 32] (float32)."""
    n, blocks = low.shape[:2]
    packed = w.highs[rows].view(n, blocks, 1, 8)
    # made on the device: a list copied there would stop a CUDA graph's capture (a Q6_K embedding)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=packed.device)[:, None]
    high = (packed >> shifts) & 3   # [n, blocks, c // 8, c % 8]
    q = (low + high.reshape(n, blocks, BLOCK).float() * 16 - 32).view(n, -1, Q6_GROUP)
    d = w.supers[rows].float()[:, :, 0].repeat_interleave(SUPER_BLOCK // Q6_GROUP, dim=1)
    return (q * (d * w.scales[rows].float())[:, :, None]).view(n, -1)


def block_scales(w: Int4Weight, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [rows, k/32] each block's scale and min: w = scale * q + min."""
    scales = w.scales[rows].float()
    if w.supers is not None:
        supers = w.supers[rows].float().repeat_interleave(SUPER_BLOCK // BLOCK, dim=1)
        return supers[:, :, 0] * scales, -(supers[:, :, 1] * w.mins[rows].float())
    return scales, scales * -8 if w.mins is None else w.mins[rows].float()


def linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x . w^T (+ bias) in x's dtype: x quantized to int16 blocks as the native kernels take it
    (activations_q16), multiplied in float32 by the dequantized weights, ROWS_AT_ONCE output rows
    at a time."""
    n = w.shape[0]
    x32 = activations_q16.quantized(x)
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32, device=x.device)
    for start in range(0, n, ROWS_AT_ONCE):
        rows = slice(start, min(start + ROWS_AT_ONCE, n))
        y[..., rows] = x32 @ dequantize(w, rows).T
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def rows(ids: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """float32 [len(ids), k]: the rows ids of the matrix (an embedding table's)."""
    return dequantize(Int4Weight(*(None if t is None else t[ids] for t in (w.values, w.scales, w.mins, w.supers, w.highs))))


def hold_int4(module: nn.Module, form: str) -> None:
    """Give module (a linear layer or an embedding, its memory allocated, not yet filled) the
    4-bit weights of form (q4_0, q4_1, q4_k, q6_k): its weight becomes the bytes, beside it the
    scales, mins, supers and highs the form has (int4_layout)."""
    device = module.weight.device
    for suffix, (shape, dtype) in pieces(form, *module.weight.shape).items():
        parameter = nn.Parameter(torch.empty(shape, dtype=getattr(torch, dtype), device=device), requires_grad=False)
        if suffix:
            module.register_parameter("weight" + suffix, parameter)
        else:
            module.weight = parameter

