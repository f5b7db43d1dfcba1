"""quantization = "int8" for a handler: its model's nn.Linear layers as torch's dynamically
quantized ones (int8 weights, each input quantized to 8 bits on the fly, int8 matmuls by
fbgemm/onednn on the CPU), and how closely the quantized model's outputs follow the float ones.

torch's own quantize_dynamic rather than mcpd's weight-only int8 (mcpd/quant/int8.py): any
module a user hands in works, with kernels torch keeps for every CPU. It runs on the CPU only.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import nn


def quantize_linear_int8(module: nn.Module) -> nn.Module:
    """A copy of `module` (on the CPU) with every nn.Linear dynamically quantized to int8."""
    if any(p.device.type != "cpu" for p in module.parameters()):
        raise ValueError("quantization = \"int8\" runs on the CPU: torch's dynamic int8 has no GPU kernels")
    with warnings.catch_warnings():   # torch marks torch.ao.quantization deprecated in favour of torchao,
        warnings.simplefilter("ignore")   # a dependency mcpd does not carry; it still ships and runs
        return torch.ao.quantization.quantize_dynamic(module, {nn.Linear}, dtype=torch.qint8)


def quantize_handler(handler) -> None:
    """quantization = "int8" on a handler version: its `model` (set by setup) quantized in place
    of the float one, which predict then runs."""
    if not isinstance(handler.model, nn.Module):
        raise ValueError("quantization = \"int8\" quantizes the handler's torch model, and its setup "
                         "kept none in self.model")
    handler.model = quantize_linear_int8(handler.model)


def top1_agreement(reference: np.ndarray, candidate: np.ndarray) -> float:
    """A classifier's: the share of rows whose highest logit is the same label."""
    return float(np.mean(reference.argmax(-1) == candidate.argmax(-1)))


def mean_cosine(reference: np.ndarray, candidate: np.ndarray) -> float:
    """An embedder's: the mean cosine similarity of each row's two vectors."""
    ref, cand = reference.reshape(len(reference), -1), candidate.reshape(len(candidate), -1)
    norms = np.linalg.norm(ref, axis=1) * np.linalg.norm(cand, axis=1)
    return float(np.mean((ref * cand).sum(1) / np.maximum(norms, np.finfo(np.float32).tiny)))


def max_abs_diff(reference: np.ndarray, candidate: np.ndarray) -> float:
    """A scorer's: the largest difference of any score."""
    return float(np.max(np.abs(reference.astype(np.float64) - candidate.astype(np.float64)), initial=0.0))


MEASURES = {"top1": top1_agreement, "cosine": mean_cosine, "max_abs_diff": max_abs_diff}


def agreement(reference: np.ndarray, candidate: np.ndarray, measure: str) -> float:
    """How closely `candidate` (a quantized model's output) follows `reference` (the float
    model's, same rows), by one of MEASURES."""
    if reference.shape != candidate.shape:
        raise ValueError(f"outputs of shapes {reference.shape} and {candidate.shape} cannot be compared")
    return MEASURES[measure](reference, candidate)
