"""Load a model from a GGUF file: the skeleton its metadata describes (gguf_architecture.py),
filled with its tensors under their Hugging Face names, and the tokenizer it carries.

Q8_0, Q5_0, Q4_0, Q4_1, Q4_K and Q6_K matrices stay quantized (gguf_blocks.py: as the skeleton's
int8 and 4-bit parameters hold them, gguf_file.KEPT_QUANTIZED; a fused matrix whose pieces mix
them, in parts: split_linear.py); a matrix with a piece of another type (a float one among
quantized ones) is dequantized here, at load, to the model's dtype, with one warning line naming
the types.

llama.cpp's converter permutes the rows of a Llama model's Q and K projections into the
interleaved rotary layout its kernels use; the engine, like transformers, rotates halves, so
those rows are put back (as transformers does when it loads a GGUF). Qwen2 files are not permuted.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from mcpd import gguf_file
from mcpd.config import ModelConfig
from mcpd.models import gguf_blocks
from mcpd.models.architecture import LlamaArgs
from mcpd.models.gguf_architecture import ROPE_FREQS, fused_name, hf_name
from mcpd.models.loader import LoadedModel, copy_weights, fill_weights, skeleton
from mcpd.tokenizer import HFTokenizer

log = logging.getLogger("mcpd.models")
FLOAT_TYPES = ("F32", "F16", "BF16")


def load(config: ModelConfig, device: torch.device, kernels: str = "torch", resident=None) -> LoadedModel:
    """kernels, resident: as loader.load_checkpoint."""
    path = Path(config.path)
    model, hf, dtype, vocab_size, model_len = skeleton(config, device)
    metadata = gguf_file.open_gguf(path)
    reason = fill_weights(model, path.name, kernels, resident,
                          lambda: copy_weights(model, _tensors(metadata, model.args, hf, dtype, path), path))
    tokenizer = HFTokenizer.from_gguf(path, config.content_special_tokens)
    gguf_file.forget()
    return LoadedModel(model, tokenizer, path.name, dtype, vocab_size, min(config.max_model_len, model_len), reason)


def _tensors(metadata, args: LlamaArgs, hf: dict, dtype: torch.dtype, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    kept = hf[gguf_file.KEPT_QUANTIZED]
    is_kept = {t.name: fused_name(hf_name(t.name) or "") in kept for t in metadata.tensors}
    quantized = [t for t in metadata.tensors if t.tensor_type.name not in FLOAT_TYPES]
    kept_types = sorted({t.tensor_type.name for t in quantized if is_kept[t.name]})
    dequantized = sorted({t.tensor_type.name for t in quantized if not is_kept[t.name]})
    if kept_types:
        log.info("%s: %s tensors stay quantized in memory", path.name, ", ".join(kept_types))
    if dequantized:
        log.warning("%s: %s tensors dequantized to %s at load (no kernels read them quantized)",
                    path.name, ", ".join(dequantized), str(dtype).removeprefix("torch."))
    permuted = hf["gguf_architecture"] == "llama"
    for tensor in metadata.tensors:
        if tensor.name == ROPE_FREQS:   # read into the rope scaling (gguf_architecture.py)
            continue
        name = hf_name(tensor.name)
        data = metadata.data(tensor)
        pieces = (gguf_blocks.pieces(data, tensor.tensor_type.name, int(tensor.shape[-1]))
                  if is_kept[tensor.name] else {"": _dequantized(tensor, data)})
        for suffix, weights in pieces.items():
            if permuted and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
                heads = args.num_heads if ".attn_q." in tensor.name else args.num_kv_heads
                weights = _rotate_halves(weights, heads)
            yield name + suffix, torch.from_numpy(weights)


def _dequantized(tensor, data: np.ndarray) -> np.ndarray:
    """The tensor as float32 (a float one as it is), in its Hugging Face shape (rows first)."""
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape))
    if tensor.tensor_type.name == "F32":
        return np.array(data, dtype=np.float32).reshape(shape)   # a copy: the map is read-only
    return dequantize(data, tensor.tensor_type).reshape(shape)


def _rotate_halves(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's permute: in each head, rows (2i, 2i+1) go back to (i, i + head_dim/2)."""
    rows = weights.shape[0]
    return (weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))
