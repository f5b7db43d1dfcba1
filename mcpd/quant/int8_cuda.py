"""The weight-only int8 product on a CUDA device, as Triton kernels: y = x . w^T (+ bias), w
read as int8 values and their float32 group scales (int8.py) and converted in registers.

Why kernels: the torch twin (int8.linear) dequantizes the whole matrix to float32 on every
call, writing and reading 4 bytes a weight where the float model reads 2 (bfloat16), so on a GPU
it is slower than the model it should speed up. Here each int8 byte is read from memory once.

Two kernels, by the number of rows:
- `_rows_product`, one or two rows (a decode step of one or two sequences): one program per row
  and BLOCK_N outputs, elementwise on the CUDA cores. It sums each group's products in float32
  and scales the group's sum, a multiply a group (as kernels.c's one-row case), leaving an add
  and a multiply a weight: the bytes bound it.
- `_tile_product`, more rows: a GEMM's tiles on the tensor cores. Each BLOCK_K = GROUP columns
  share a scale per output, so a tile dequantizes with one multiply a weight and rounds it to x's
  dtype (bfloat16 or float16, the tensor cores' inputs; a float32 x goes in as TF32, exact for
  x's 16-bit twins and 2^-11 relative on the weight).
Rounding: the twin multiplies x rounded to int16 (activations_q16.int16_rows, as the native CPU kernels)
by the float32 dequantized matrix; these kernels take x as it is. The rows kernel differs from
it by that rounding (2^-16 of a row's largest value a weight at most) and the order of float32
sums, the tile kernel also by the weight's rounding to the dot's type (2^-9 relative for
bfloat16, under the int8 step's 2^-8). tests/test_int8.py holds both to
the twin within that, and the model's agreement on a GPU (run where one is lent: CI has none).

Tile sizes: fixed per row count (ROWS_TILE, TILES), the fastest of a sweep on an H200 over a 7B
Llama layer's matrices (bench/quantized.py on the card), rather than autotuned: no tuning at a
worker's first steps, and the same tiles, so the same sums, in every run. Against bfloat16
torch the kernels win at one row and lose once rows share the weights: dequantizing in every
tile then costs more than the bytes save (and a dequantize-then-GEMM path is no better at
hundreds of rows).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mcpd.quant.int8 import Int8Weight
from mcpd.quant.int8_layout import GROUP

ROWS_KERNEL_MAX = 2      # up to this many rows, _rows_product (each row reads the weights from L2 again)
ROWS_TILE = dict(BLOCK_N=4, BLOCK_K=1024, num_warps=8)
TILES = [(16, dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=4)),   # (most rows, tile)
         (64, dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=4)),
         (256, dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)),
         (None, dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=4))]


@triton.jit
def _rows_product(x, values, scales, bias, y, M, N, K, x_row_stride, values_row_stride, scales_row_stride,
                  y_row_stride, GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = outs < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in tl.range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        a = tl.load(x + row * x_row_stride + cols, mask=col_ok, other=0.0).to(tl.float32)
        w = tl.load(values + outs[:, None] * values_row_stride + cols[None, :],
                    mask=out_ok[:, None] & col_ok[None, :], other=0).to(tl.float32)
        sums = tl.sum(tl.reshape(w * a[None, :], (BLOCK_N, BLOCK_K // GROUP_SIZE, GROUP_SIZE)), axis=2)
        groups = start // GROUP_SIZE + tl.arange(0, BLOCK_K // GROUP_SIZE)
        s = tl.load(scales + outs[:, None] * scales_row_stride + groups[None, :],
                    mask=out_ok[:, None] & (groups * GROUP_SIZE < K)[None, :], other=0.0)
        acc += tl.sum(sums * s, axis=1)
    if HAS_BIAS:
        acc += tl.load(bias + outs, mask=out_ok, other=0.0).to(tl.float32)
    tl.store(y + row * y_row_stride + outs, acc.to(y.dtype.element_ty), mask=out_ok)


@triton.jit
def _tile_product(x, values, scales, bias, y, M, N, K, x_row_stride, values_row_stride, scales_row_stride,
                  y_row_stride, GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, out_ok = rows < M, outs < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in tl.range(0, K, GROUP_SIZE):
        cols = start + tl.arange(0, GROUP_SIZE)
        col_ok = cols < K
        a = tl.load(x + rows[:, None] * x_row_stride + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        w = tl.load(values + outs[None, :] * values_row_stride + cols[:, None],
                    mask=col_ok[:, None] & out_ok[None, :], other=0).to(tl.float32)
        s = tl.load(scales + outs * scales_row_stride + start // GROUP_SIZE, mask=out_ok, other=0.0)
        w = w * s[None, :]
        if a.dtype == tl.float32:
            acc = tl.dot(a, w, acc, input_precision="tf32")
        else:
            acc = tl.dot(a, w.to(a.dtype), acc)
    if HAS_BIAS:
        acc += tl.load(bias + outs, mask=out_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y + rows[:, None] * y_row_stride + outs[None, :], acc.to(y.dtype.element_ty),
             mask=row_ok[:, None] & out_ok[None, :])


def linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """int8.linear's product on x's CUDA device: x [..., k] in any float dtype, y [..., n] in it."""
    n, k = weight.values.shape
    rows = x.reshape(-1, k)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    operands = (rows, weight.values, weight.scales, bias if bias is not None else y, y, m, n, k,
                rows.stride(0), weight.values.stride(0), weight.scales.stride(0), y.stride(0))
    constants = dict(GROUP_SIZE=GROUP, HAS_BIAS=bias is not None)
    if 0 < m <= ROWS_KERNEL_MAX:
        _rows_product[(m, triton.cdiv(n, ROWS_TILE["BLOCK_N"]))](*operands, **constants, **ROWS_TILE)
    elif m:
        tile = next(tile for most, tile in TILES if most is None or m <= most)
        grid = (triton.cdiv(m, tile["BLOCK_M"]), triton.cdiv(n, tile["BLOCK_N"]))
        _tile_product[grid](*operands, **constants, **tile)
    return y.view(*x.shape[:-1], n)
