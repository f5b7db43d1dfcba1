"""A linear layer in int8 for a CUDA device (W8A8): its weights quantized once, symmetric, one
scale per output row; each input row quantized on every call with its own scale; the int8
product by `torch._int_mm` (int8 x int8 -> int32, cuBLAS on the tensor cores), scaled back to the
input's dtype. torch._int_mm runs on the CPU too, so the CPU runs this same code as its test twin.

torch._int_mm on CUDA takes more than 16 rows and inner and output widths that are multiples of
8: the weights are padded with zero rows and columns once, each input with 17 zero rows and its
missing zero columns on every call (zeros add nothing to a product), and the result sliced
back, so any batch and any layer width works.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INT8_MAX = 127   # symmetric: -128 is left out, so that a value's negation fits as well
# torch._int_mm on CUDA takes more than 16 rows: every input gets this many zero rows below its
# own, a constant, so that a traced model's graph has no branch on the batch's rows to lose
PAD_ROWS = 17
WIDTH_MULTIPLE = 8   # ... and both widths multiples of 8
# The int32 sum of k products of at most 127 * 127 must not overflow
MAX_IN_FEATURES = (2 ** 31 - 1) // (INT8_MAX * INT8_MAX) // WIDTH_MULTIPLE * WIDTH_MULTIPLE


def padded(width: int) -> int:
    return -(-width // WIDTH_MULTIPLE) * WIDTH_MULTIPLE


def quantized_rows(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of a matrix as int8 in [-127, 127] times its scale (max |row| / 127, float32, a
    column). A row holding a NaN or an infinity keeps a non-finite scale: its int8 values mean
    nothing, and the scale makes its outputs non-finite, as the float layer's are."""
    matrix = matrix.float()
    scale = matrix.abs().amax(1, keepdim=True) / INT8_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)   # an all-zero row stays 0, not 0/0
    return torch.round(matrix / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


class W8A8Linear(nn.Module):
    """An nn.Linear's int8 twin, on the linear's device."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if padded(self.in_features) > MAX_IN_FEATURES:
            raise ValueError(f"an int8 linear of {self.in_features} inputs would overflow its int32 sums "
                             f"(at most {MAX_IN_FEATURES})")
        with torch.no_grad():
            values, scale = quantized_rows(linear.weight)
            values = F.pad(values, (0, padded(self.in_features) - self.in_features,
                                    0, padded(self.out_features) - self.out_features))
            self.register_buffer("values", values.contiguous())   # [n, k]: values.t() is the column-major
            self.register_buffer("weight_scale", scale.reshape(-1))   # operand cuBLAS's int8 product takes
            self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x's own width, so that a wrong one fails torch._int_mm's check instead of being reshaped
        quantized, scale = quantized_rows(x.reshape(-1, x.shape[-1]))
        quantized = F.pad(quantized, (0, self.values.shape[1] - self.in_features, 0, PAD_ROWS))
        products = torch._int_mm(quantized, self.values.t())[:-PAD_ROWS, :self.out_features]
        y = products.float() * scale * self.weight_scale
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(x.shape[:-1] + (self.out_features,))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
