"""The math side of mcpd: model architectures, checkpoint loading and tokenizers.

Nothing here knows about requests or scheduling; the engine hands a model a flat batch of tokens
plus AttentionMetadata and gets hidden states and logits back.
"""
import torch

from mcpd.config import ModelConfig
from mcpd.models import embedded
from mcpd.models.loader import LoadedModel, UnsupportedModel, load_checkpoint, skeleton
from mcpd.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "LoadedModel", "Tokenizer", "UnsupportedModel", "load_model"]


def load_model(config: ModelConfig, device: torch.device, kernels: str = "torch", resident=None) -> LoadedModel:
    """The model in config.path, or the embedded default model when the path is empty, running on
    the kernels engine.kernels = kernels picks. resident: where the weights may be already, in
    the form those kernels read, and are kept (engine/resident_weights.py)."""
    load = load_checkpoint if config.path else embedded.load
    return load(config, device, kernels, resident)


def parameter_bytes(config: ModelConfig, device: torch.device) -> int:
    """The bytes the model's parameters take on the device, from its architecture alone (its
    skeleton is built: memory allocated, never touched, freed on return; CPU pages stay unbacked)."""
    model = skeleton(config, device)[0] if config.path else embedded.skeleton(config, device)
    return sum(p.numel() * p.element_size() for p in model.parameters())
