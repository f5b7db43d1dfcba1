"""Weight-only int8: a linear layer's weight as int8 values with one float32 scale per output row
and group of GROUP input columns.

    w[n, j] ~= values[n, j] * scales[n, j // GROUP],  values in [-127, 127],
    scales[n, g] = r * max |w[n, g*GROUP : (g+1)*GROUP]| / 127,  r in RATIOS

Per group, r is the ratio of RATIOS whose rounding leaves the least squared error (values rounded
to nearest). Why search: with 127 steps a group's error is the sum of 64 roundings, and a slightly
larger step lands the weights nearer their levels in some groups than in others; the best of
16 steps between 1 and 1.03 times the peak's lowers the model's squared weight error and its
mean KL against the float model (bench/quantized.py measures it). Ratios below 1
(clipping the peak) win nothing: the peak's error then grows by whole steps, 64 roundings' by
fractions of one. r >= 1 also keeps every weight within half a step of its value.

Symmetric (no zero point). Groups along the input: one scale per row spreads a row's 127 steps
over its largest weight, most of its weights then use a few of them; a group's peak is nearer
its typical weight (bench/quantized.py weighs group size against agreement and speed).
Groups never span rows, so a fused matrix (q/k/v, gate/up) quantizes row by row exactly as its
separate pieces would. -128 is left out so that negating a row stays exact.

Activations: the torch twin and the native kernel multiply each row of x rounded to int16 (one
float32 scale a row, max|x| / 32767: int16_rows), the native one in integers a group at a time
(vpmaddwd) and each group's sum scaled once; the twin by the dequantized weight, values * scale
rounded to float32. The same product, rounded at other places (tests/test_kernels.py). The
rounding, about 2^-15 of a row's largest value, is far below the weights' own 2^-8.

Which tensors: every nn.Linear of a Llama-family model (q/k/v, o, gate/up, down) and the LM
head. The embedding stays in the model dtype: a step reads one of its rows per token, not the
whole table, so int8 would save no bandwidth and only add error to every input (a tied head,
being the embedding, stays float with it).

Checkpoints (docs/MODELS.md): `<name>.weight` int8 [out, in] beside `<name>.weight_scale` float32
[out, groups(in)], or [out] (one scale a row: every group of the row takes it, which is exact);
everything else as in a float checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mcpd.quant.activations_q16 import int16_rows
from mcpd.quant.int8_layout import GROUP, SCALE_SUFFIX, group_of, groups

LEVELS = 127
RATIOS = torch.linspace(1.0, 1.03, 16).tolist()   # steps tried per group, times peak / LEVELS
ROWS_AT_ONCE = 256        # rows searched together: their candidates' roundings stay in cache


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """A weight matrix as the torch kernels multiply it: values int8 [n, k], scales float32 [n, groups(k)]."""
    values: torch.Tensor
    scales: torch.Tensor


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values [n, k], float32 scales [n, groups(k)]) of a float matrix; an all-zero group
    gets scale 1. Rows are quantized independently (so a fused matrix as its pieces)."""
    n, k = weight.shape
    w = F.pad(weight.float(), (0, groups(k) * GROUP - k)).view(n, groups(k), GROUP)
    scales = torch.cat([best_scales(rows) for rows in w.split(ROWS_AT_ONCE)])
    values = torch.round(w / scales[:, :, None]).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return values.view(n, -1)[:, :k].contiguous(), scales


def best_scales(w: torch.Tensor) -> torch.Tensor:
    """float32 [rows, groups]: each group's scale (of w [rows, groups, GROUP]) among RATIOS
    times its peak / LEVELS, the one whose rounding errs least; 1 for an all-zero group."""
    peak = w.abs().amax(dim=2, keepdim=True)
    base = torch.where(peak > 0, peak / LEVELS, torch.ones_like(peak))
    best, least = base, None
    for ratio in RATIOS:
        scale = base * ratio
        error = (torch.round(w / scale) * scale - w).square_().sum(dim=2, keepdim=True)
        if least is None:
            best, least = scale, error
        else:
            better = error < least
            best, least = torch.where(better, scale, best), torch.where(better, error, least)
    return best.squeeze(2)


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [n, k]: the matrix the int8 values and scales stand for, each value * its scale
    rounded to float32 (as the native kernel converts them in registers)."""
    group = group_of(values.shape[1], scales.shape[1])
    return values.float() * scales.repeat_interleave(group, dim=1)[:, :values.shape[1]]


def rows(ids: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """float32 [len(ids), k]: the rows ids of the matrix (an embedding table's)."""
    return dequantize(weight.values[ids], weight.scales[ids])


def linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x . w^T (+ bias) in x's dtype: x's rows rounded to int16 (int16_rows) times the dequantized
    weight, in float32, then the row's scale, as the native kernel (kernels.c, tile_int8) computes
    it. The torch twin of it: it converts the values on every call, which is slow, but it runs on
    any device and keeps memory at one byte a weight (and a scale per GROUP)."""
    levels, scale = int16_rows(x)
    y = F.linear(levels, dequantize(weight.values, weight.scales)) * scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def use_int8(model: nn.Module) -> None:
    """Give every nn.Linear of model (its memory allocated, not yet filled) an int8 weight and a
    float32 weight_scale [out, groups(in)]: the loader fills both, from an int8 checkpoint or by
    quantize."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            hold_int8(module, GROUP)


def hold_int8(module: nn.Module, group: int) -> None:
    """Give module (a linear layer or an embedding, its memory allocated, not yet filled) an int8
    weight and a float32 weight_scale [out, groups(in, group)]."""
    rows, columns = module.weight.shape
    device = module.weight.device
    module.weight = nn.Parameter(torch.empty(rows, columns, dtype=torch.int8, device=device), requires_grad=False)
    module.register_parameter("weight" + SCALE_SUFFIX, nn.Parameter(
        torch.empty(rows, groups(columns, group), dtype=torch.float32, device=device), requires_grad=False))


def matrix(module: nn.Linear) -> torch.Tensor | Int8Weight:
    """A linear layer's weight as the kernels' prepare() takes it: the tensor, or Int8Weight."""
    scales = getattr(module, "weight" + SCALE_SUFFIX, None)
    return module.weight if scales is None else Int8Weight(module.weight, scales)


def bad_scales(scales: torch.Tensor) -> str | None:
    """Why a checkpoint's scales cannot be used (not float32, not finite and positive), or None.
    Their shape is the loader's to check, as for every tensor."""
    if scales.dtype != torch.float32:
        return f"dtype {scales.dtype}, not float32"
    if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
        return "a scale that is not finite and positive"
    return None
