"""A BERT-shaped handler's forward as a TorchScript graph, traced once per model. transformers'
modules spend a fixed Python cost on every call (config look-ups, output dataclasses, mask
helpers), as much as a small model's compute over a few rows: traced, that cost leaves every
batch, and a batch's cost is close to its rows' compute.

The example is traced with a padded row, so the graph always applies the attention mask; a batch
without padding applies it as all ones, which gives the outputs the untraced forward gives."""
from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

# TorchScript profiles and optimises a graph on its first runs: run here, not on the first
# requests a worker serves
WARM_RUNS = 2

Forward = Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]


class _Module(torch.nn.Module):
    """The forward as a module that owns the model, so that tracing sees its weights."""

    def __init__(self, model: torch.nn.Module, forward: Forward):
        super().__init__()
        self.model, self.run = model, forward

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.run(ids, mask)


def traced_forward(model: torch.nn.Module, forward: Forward, token_id: int, device: torch.device) -> Forward:
    """`forward` (which runs `model` over ids and their mask) traced on a two-row example whose
    second row is padded; the graph takes any rows and length the model's positions allow."""
    ids = torch.full((2, 4), token_id, dtype=torch.int64, device=device)
    mask = torch.ones_like(ids)
    mask[1, 2:] = 0
    ids[1, 2:] = 0
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the tracer's notes on transformers' Python-side checks
        graph = torch.jit.freeze(torch.jit.trace(_Module(model, forward).eval(), (ids, mask),
                                                 strict=False, check_trace=False))
        for _ in range(WARM_RUNS):
            graph(ids, mask)
    return graph
