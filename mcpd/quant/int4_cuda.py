"""The 4-bit products on a CUDA device, as Triton kernels: y = x . w^T (+ bias), w an Int4Weight of
any form (int4.py: Q4_0, Q4_1, Q4_K, Q6_K), each packed byte read from memory once and its two
weights converted in registers.

Why kernels: the torch twin (int4.linear) dequantizes panels of rows to float32 on every call,
writing and reading 4 bytes a weight where the bytes hold half of one, so on a GPU it is slower
than the bfloat16 model it should speed up.

The weights are int4.dequantize's bit for bit, formed as it forms them in float32: Q4_0 and Q4_1
d * q + m (Q4_0's m = -8 d), Q4_K (d * sc) * q - dmin * m, Q6_K (d * scale) * (q - 32), each
product before the last exact, so each weight rounds once wherever the multiply-add is fused.
Every form keeps Q4_1's nibble order: byte j of a block of 32 columns holds column j (low
nibble) and column j + 16 (high nibble), so a kernel takes the bytes of a chunk as they lie and
x's columns in two loads, one for each nibble (Q6_K: its top two bits from highs, byte j % 8,
shifted by 2 (j // 8) for the low nibble's column, 4 more for the high one's). Both kernels
shape a chunk with the block and the byte in it as dimensions of their own ([.., blocks, 16, ..]):
a block's scale and min are then one load, not one a weight, and Triton pipelines the tile
kernel's loads (asynchronous copies), which a flat byte index left as scalar loads.

Two kernels, by the number of rows, as int8_cuda.py:
- `_rows_product`, one or two rows (a decode step of one or two sequences): one program per row
  and BLOCK_N outputs, the weights dequantized and multiplied elementwise on the CUDA cores and
  summed in float32: the bytes bound it.
- `_tile_product`, more rows: a GEMM's tiles on the tensor cores, each step's [BLOCK_K / 2, BLOCK_N]
  bytes dequantized to two tiles (the low nibbles' columns and the high ones') rounded to x's
  dtype (bfloat16 or float16; a float32 x goes in as TF32), two tl.dot a step.
Rounding: the twin multiplies x rounded to int16 blocks of 32 (activations_q16.quantized, as the
native CPU kernels take it) by the float32 weights; these kernels take x as it is. The rows
kernel differs from it by that rounding (half a step of 2^-15 of a block's largest value, a
weight) and the order of float32 sums; the tile kernel also by the weight's rounding to the
dot's type (2^-9 relative for bfloat16; TF32 rounds x too, 2^-11 each). tests/test_int4_cuda.py
holds both to the twin within that.

Tile sizes: fixed per row count, not autotuned (no tuning at a worker's first steps, and the same
tiles, so the same sums, in every run): int8_cuda.py's, swept on an H200 for its int8 kernels;
the rows kernel with half its warps for half its bytes a step (16 a thread, as there), the tiles
a chunk of TILE_K = 64 columns (two blocks, a dot's K of 32). Not swept for these kernels yet
(bench/gpu_decode.py --gguf measures them).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mcpd.quant.int4 import Int4Weight
from mcpd.quant.int8_cuda import ROWS_KERNEL_MAX, TILES

Q4_0, Q4_1, Q4_K, Q6_K = range(4)   # the form, a constant of each kernel's compilation
ROWS_TILE = dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4)
TILE_K = 64                         # columns a tile kernel's step dequantizes: two blocks


@triton.jit
def _weights(values, scales, mins, supers, highs, values_stride, scales_stride, mins_stride, supers_stride,
             supers_step, highs_stride, outs, block, position, ok, FORM: tl.constexpr):
    """float32 (the low nibbles' weights, the high nibbles' weights) of byte `position` (0-15)
    of block `block` of output rows `outs`, shaped as the three broadcast; 0 where not ok (outs
    and block). Scales are loaded in the shape of outs and block alone: once a block where
    position is a dimension of its own."""
    packed = tl.load(values + outs * values_stride + block * 16 + position, mask=ok, other=0).to(tl.int32)
    low, high = (packed & 15).to(tl.float32), (packed >> 4).to(tl.float32)
    if FORM == 3:   # Q6_K: w = (d * scale) * (q - 32), a scale each 16 columns: the low and the high nibbles'
        top = tl.load(highs + outs * highs_stride + block * 8 + position % 8, mask=ok, other=0).to(tl.int32)
        shift = (position // 8) * 2
        low = low + ((top >> shift) & 3).to(tl.float32) * 16 - 32
        high = high + ((top >> (shift + 4)) & 3).to(tl.float32) * 16 - 32
        d = tl.load(supers + outs * supers_stride + (block // 8) * supers_step, mask=ok, other=0.0).to(tl.float32)
        low_scale = d * tl.load(scales + outs * scales_stride + block * 2, mask=ok, other=0).to(tl.float32)
        high_scale = d * tl.load(scales + outs * scales_stride + block * 2 + 1, mask=ok, other=0).to(tl.float32)
        return low * low_scale, high * high_scale
    else:
        scale = tl.load(scales + outs * scales_stride + block, mask=ok, other=0).to(tl.float32)
        if FORM == 2:   # Q4_K: d * sc and -(dmin * m), d and dmin the super-block's
            super_block = supers + outs * supers_stride + (block // 8) * supers_step
            scale = tl.load(super_block, mask=ok, other=0.0).to(tl.float32) * scale
            least = -(tl.load(super_block + 1, mask=ok, other=0.0).to(tl.float32)
                      * tl.load(mins + outs * mins_stride + block, mask=ok, other=0).to(tl.float32))
        elif FORM == 1:
            least = tl.load(mins + outs * mins_stride + block, mask=ok, other=0.0).to(tl.float32)
        else:
            least = scale * -8
        return low * scale + least, high * scale + least


@triton.jit
def _rows_product(x, values, scales, mins, supers, highs, bias, y, M, N, K, x_row_stride, y_row_stride,
                  values_stride, scales_stride, mins_stride, supers_stride, supers_step, highs_stride,
                  FORM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = outs < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for first in tl.range(0, K // 32, BLOCK_K // 32):
        block = first + tl.arange(0, BLOCK_K // 32)
        block_ok = block < K // 32
        column = x + row * x_row_stride + block[:, None] * 32 + tl.arange(0, 16)[None, :]   # the low nibbles'
        a_low = tl.load(column, mask=block_ok[:, None], other=0.0).to(tl.float32)
        a_high = tl.load(column + 16, mask=block_ok[:, None], other=0.0).to(tl.float32)
        w_low, w_high = _weights(values, scales, mins, supers, highs, values_stride, scales_stride, mins_stride,
                                 supers_stride, supers_step, highs_stride, outs[:, None, None], block[None, :, None],
                                 tl.arange(0, 16)[None, None, :], out_ok[:, None, None] & block_ok[None, :, None],
                                 FORM)
        acc += tl.sum(tl.sum(w_low * a_low[None, :, :] + w_high * a_high[None, :, :], axis=2), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias + outs, mask=out_ok, other=0.0).to(tl.float32)
    tl.store(y + row * y_row_stride + outs, acc.to(y.dtype.element_ty), mask=out_ok)


@triton.jit
def _dot(a, w, acc):
    """acc + a . w on the tensor cores: w rounded to a's 16-bit dtype, or both to TF32."""
    if a.dtype == tl.float32:
        return tl.dot(a, w, acc, input_precision="tf32")
    else:
        return tl.dot(a, w.to(a.dtype), acc)


@triton.jit
def _tile_product(x, values, scales, mins, supers, highs, bias, y, M, N, K, x_row_stride, y_row_stride,
                  values_stride, scales_stride, mins_stride, supers_stride, supers_step, highs_stride,
                  FORM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, out_ok = rows < M, outs < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for first in tl.range(0, K // 32, BLOCK_K // 32):
        block = first + tl.arange(0, BLOCK_K // 32)
        block_ok = block < K // 32
        columns = (x + rows[:, None, None] * x_row_stride + block[None, :, None] * 32
                   + tl.arange(0, 16)[None, None, :])   # the low nibbles'
        a_ok = row_ok[:, None, None] & block_ok[None, :, None]
        a_low = tl.reshape(tl.load(columns, mask=a_ok, other=0.0), (BLOCK_M, BLOCK_K // 2))
        a_high = tl.reshape(tl.load(columns + 16, mask=a_ok, other=0.0), (BLOCK_M, BLOCK_K // 2))
        w_low, w_high = _weights(values, scales, mins, supers, highs, values_stride, scales_stride, mins_stride,
                                 supers_stride, supers_step, highs_stride, outs[None, None, :], block[:, None, None],
                                 tl.arange(0, 16)[None, :, None], block_ok[:, None, None] & out_ok[None, None, :],
                                 FORM)
        w_low = tl.reshape(w_low, (BLOCK_K // 2, BLOCK_N))
        w_high = tl.reshape(w_high, (BLOCK_K // 2, BLOCK_N))
        acc = _dot(a_high, w_high, _dot(a_low, w_low, acc))
    if HAS_BIAS:
        acc += tl.load(bias + outs, mask=out_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y + rows[:, None] * y_row_stride + outs[None, :], acc.to(y.dtype.element_ty),
             mask=row_ok[:, None] & out_ok[None, :])


def _form_of(weight: Int4Weight) -> int:
    """Which of Q4_0, Q4_1, Q4_K, Q6_K the weight's tensors make (int4.Int4Weight)."""
    if weight.highs is not None:
        return Q6_K
    if weight.supers is not None:
        return Q4_K
    return Q4_1 if weight.mins is not None else Q4_0


def _weight_operands(weight: Int4Weight) -> tuple:
    """The kernels' weight pointers and row strides (values standing in for a tensor the form
    lacks, never read), each tensor contiguous along its last dimension."""
    mins, supers, highs = (t if t is not None else weight.values for t in (weight.mins, weight.supers, weight.highs))
    return (weight.values, weight.scales, mins, supers, highs), (
        weight.values.stride(0), weight.scales.stride(0), mins.stride(0), supers.stride(0),
        supers.stride(1) if weight.supers is not None else 0, highs.stride(0))


def linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """int4.linear's product on x's CUDA device: x [..., k] in any float dtype, y [..., n] in it."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pointers, strides = _weight_operands(weight)
    operands = (rows, *pointers, bias if bias is not None else y, y, m, n, k, rows.stride(0), y.stride(0), *strides)
    constants = dict(FORM=_form_of(weight), HAS_BIAS=bias is not None)
    if 0 < m <= ROWS_KERNEL_MAX:
        _rows_product[(m, triton.cdiv(n, ROWS_TILE["BLOCK_N"]))](*operands, **constants, **ROWS_TILE)
    elif m:
        tile = next(tile for most, tile in TILES if most is None or m <= most)
        grid = (triton.cdiv(m, tile["BLOCK_M"]), triton.cdiv(n, tile["BLOCK_N"]))
        _tile_product[grid](*operands, **constants, **tile, BLOCK_K=TILE_K)
    return y.view(*x.shape[:-1], n)
