"""The embedded default model: runs out of the box, with no download and no config.

A small Llama (hidden 256, 4 layers, 4 query and 2 KV heads, so GQA is exercised) with weights
drawn from a seeded generator, so every machine and every restart gets the same model and the same
greedy output. Its tokenizer is byte-level: ids 0..255 are bytes, 256 is BOS and 257 EOS. The text
it writes is noise; it exists so the daemon, its batching and its benchmarks run anywhere.
"""
from __future__ import annotations

from pathlib import Path

import torch

from mcpd.config import ModelConfig
from mcpd.quant import int8
from mcpd.models.architecture import EMBEDDED_NAME as NAME
from mcpd.models.llama import LlamaForCausalLM
from mcpd.models.loader import LoadedModel, copy_weights, fill_weights, skeleton
from mcpd.tokenizer import ByteTokenizer

SEED = 20240501
WEIGHT_STD = 0.2  # wide enough for peaked next-token distributions (entropy ~2.3 nats, not 5.5)


def load(config: ModelConfig, device: torch.device, kernels: str = "torch", resident=None) -> LoadedModel:
    """kernels: engine.kernels; resident: see loader.fill_weights. Its arguments: architecture.EMBEDDED_ARGS."""
    model, _, dtype, vocab_size, model_len = skeleton(config, device)
    reason = fill_weights(model, NAME, kernels, resident, lambda: _draw(model))
    return LoadedModel(model, ByteTokenizer(), NAME, dtype, vocab_size, model_len, reason)


def _draw(model: LlamaForCausalLM) -> None:
    # Draw on the CPU, whatever the device: the same seed then gives the same weights everywhere
    # (each is drawn in float32 and cast as it is copied in). An int8 model draws the float
    # model's weights and quantizes them (copy_weights).
    generator = torch.Generator().manual_seed(SEED)
    drawn = ((name, torch.ones(param.shape) if name.endswith("norm.weight")
              else torch.randn(param.shape, generator=generator) * WEIGHT_STD)
             for name, param in model.named_parameters() if not name.endswith(int8.SCALE_SUFFIX))
    copy_weights(model, drawn, Path(NAME))
