"""A weight matrix whose output rows come in parts held in different forms, multiplied as one: a
fused q/k/v (or gate/up) of a GGUF file that mixes types, as a Q4_K_M does (attn_v in Q6_K, q and
k in Q4_K), each part kept in its own quantized form rather than the whole dequantized.

The parts are forms the kernels prepared (models/split_linear.py holds them as parameters); this
joins them for the products: the torch kernels concatenate the parts' products, the native
ones take a chain of records (kernels.c's mcpd_matrix `next`) and write each part's columns of
one output, so the decoder stack still makes one q/k/v product a layer.
"""
from __future__ import annotations

import ctypes

import torch


class RowParts:
    def __init__(self, parts: tuple, rows: tuple[int, ...]) -> None:
        """parts: each part's form (kernels.prepare's), in row order; rows: each part's rows."""
        self.parts, self.rows = parts, rows
        self.n = sum(rows)
        self._records = None   # the native chain, built once and kept: each record points at the next

    @property
    def k(self) -> int:
        return self.parts[0].k

    def matrix(self):
        """The first part's native record, linked to the rest's (kept alive here)."""
        if self._records is None:
            self._records = [part.matrix() for part in self.parts]
            for record, rows, following in zip(self._records, self.rows, self._records[1:]):
                record.next, record.rows = ctypes.pointer(following), rows
        return self._records[0]

    def linear(self, kernels, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x times the whole matrix (+ bias) with kernels' product of each part (and its bias:
        added before the product is rounded, as for a matrix of one part)."""
        biases = [None] * len(self.parts) if bias is None else bias.split(self.rows)
        return torch.cat([kernels.linear(x, part, b) for part, b in zip(self.parts, biases)], dim=-1)
