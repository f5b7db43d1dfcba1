"""The math side of mcpd: model architectures, checkpoint loading and tokenizers.

Nothing here knows about requests or scheduling; the engine hands a model a flat batch of tokens
plus AttentionMetadata and gets hidden states and logits back.
"""
import torch

from mcpd.config import ModelConfig
from mcpd.models import embedded
from mcpd.models.loader import LoadedModel, UnsupportedModel, load_checkpoint
from mcpd.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "LoadedModel", "Tokenizer", "UnsupportedModel", "load_model"]


def load_model(config: ModelConfig, device: torch.device) -> LoadedModel:
    """The model in config.path, or the embedded default model when the path is empty."""
    return load_checkpoint(config, device) if config.path else embedded.load(config, device)
