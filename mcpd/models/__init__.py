"""The math side of mcpd: model architectures, checkpoint loading and tokenizers.

Nothing here knows about requests or scheduling; the engine hands a model a flat batch of tokens
plus AttentionMetadata and gets hidden states and logits back.

The package imports its names lazily (as mcpd.memory its DevicePool): the pool keeper sizes a
CPU pool from architecture.py and parameter_table.py, which need no torch, and must not pay for
torch's import (a second of CPU at every daemon start) by importing this package first.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from mcpd.config import ModelConfig
    from mcpd.models.loader import LoadedModel

__all__ = ["ByteTokenizer", "HFTokenizer", "LoadedModel", "Tokenizer", "UnsupportedModel", "load_model", "skeleton"]
_HOMES = {"ByteTokenizer": "mcpd.tokenizer", "HFTokenizer": "mcpd.tokenizer", "Tokenizer": "mcpd.tokenizer",
          "LoadedModel": "mcpd.models.loader", "UnsupportedModel": "mcpd.models.architecture"}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_model(config: ModelConfig, device: torch.device, kernels: str = "torch", resident=None) -> LoadedModel:
    """The model in config.path (a checkpoint directory or a GGUF file), or the embedded default
    model, running on the kernels engine.kernels = kernels picks. resident: where the weights may
    be already, in the form those kernels read, and are kept (engine/resident_weights.py)."""
    from mcpd import gguf_file
    from mcpd.models import architecture, embedded, gguf_loader, loader

    load = (embedded.load if architecture.is_embedded(config.path)
            else gguf_loader.load if gguf_file.is_gguf(config.path) else loader.load_checkpoint)
    return load(config, device, kernels, resident)


def skeleton(config: ModelConfig, device: torch.device) -> nn.Module:
    """The model config describes, its parameters' memory allocated on the device, never touched
    (CPU pages stay unbacked) and not filled (loader.skeleton)."""
    from mcpd.models import loader

    return loader.skeleton(config, device)[0]
