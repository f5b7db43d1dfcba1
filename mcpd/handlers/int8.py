"""quantization = "int8" for a handler: its model's nn.Linear layers in int8, with weights and
each input quantized to 8 bits and int8 matmuls, and how closely the quantized model's outputs
follow the float ones.

Where each runs: a model on the CPU gets torch's dynamically quantized linear
(torch.ao.quantization.quantize_dynamic, fbgemm/onednn kernels) rather than mcpd's weight-only
int8 (mcpd/quant/int8.py): any module a user hands in works, with kernels torch keeps for every
CPU. torch's dynamic int8 has no GPU kernels, so a model on a CUDA device gets W8A8Linear
(w8a8_linear.py, torch._int_mm on the tensor cores). Any other device is refused.
"""
from __future__ import annotations

import copy
import warnings

import numpy as np
import torch
from torch import nn

from mcpd.handlers.w8a8_linear import W8A8Linear

DEVICES = ("cpu", "cuda")


def quantize_linear_int8(module: nn.Module, *, force_int_mm: bool = False) -> nn.Module:
    """A copy of `module` with every nn.Linear in int8, by the device its parameters are on (the
    module is left as it was). force_int_mm: the CUDA device's W8A8Linear on the CPU as well, its
    test twin."""
    devices = sorted({p.device.type for p in module.parameters()}) or ["cpu"]
    if len(devices) > 1 or devices[0] not in DEVICES:
        raise ValueError(f"quantization = \"int8\" runs on the CPU (torch's dynamic int8) or a CUDA device "
                         f"(torch._int_mm); the model is on {' and '.join(devices)}")
    if devices == ["cuda"] or force_int_mm:
        return with_w8a8_linears(module)
    with warnings.catch_warnings():   # torch marks torch.ao.quantization deprecated in favour of torchao,
        warnings.simplefilter("ignore")   # a dependency mcpd does not carry; it still ships and runs
        return torch.ao.quantization.quantize_dynamic(module, {nn.Linear}, dtype=torch.qint8)


def with_w8a8_linears(module: nn.Module) -> nn.Module:
    """A copy of `module` whose nn.Linear layers are W8A8Linear ones. Subclasses are left as
    quantize_dynamic leaves them: MultiheadAttention's out_proj, say, whose weight its owner reads."""
    if type(module) is nn.Linear:
        return W8A8Linear(module)
    # The linears are not copied (a model on a GPU would briefly hold its float weights twice):
    # the copy shares them until the loop below replaces each in the copy alone
    linears = {id(m): m for m in module.modules() if type(m) is nn.Linear}
    quantized = copy.deepcopy(module, memo=dict(linears))
    for parent in list(quantized.modules()):
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                setattr(parent, name, W8A8Linear(child))
    return quantized


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
