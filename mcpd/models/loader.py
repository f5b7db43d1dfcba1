"""Load a causal LM from a local Hugging Face directory: config.json, *.safetensors, tokenizer.json.

Supported: the architectures of architecture.ARCHITECTURES (docs/MODELS.md lists them) in float32,
float16 or bfloat16. Everything else is refused up front with UnsupportedModel naming the exact
feature, rather than loading and then generating garbage (config.json's refusals: architecture.py).

dtype "auto" means the checkpoint's own dtype, except that half-precision checkpoints run in
float32 on the CPU: CPU float16/bfloat16 matmul kernels are several times slower than float32 ones,
so there the memory saving would cost most of the speed. Ask for bfloat16 explicitly to get it.
"""
from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from mcpd import gguf_file
from mcpd.config import ModelConfig
from mcpd.models import architecture, split_linear
from mcpd.quant import int4, int8
from mcpd.quant.int8_layout import GGUF_GROUP
from mcpd.models.architecture import GemmaArgs, LlamaArgs, UnsupportedModel, read_json
from mcpd.models.gemma import GemmaForCausalLM
from mcpd.models.gpt2 import GPT2LMHeadModel
from mcpd.kernels.forms import Form
from mcpd.models.layers import AttentionMetadata
from mcpd.models.llama import LlamaForCausalLM
from mcpd.tokenizer import HFTokenizer, Tokenizer, eos_token_ids

DTYPES = {name: getattr(torch, name) for name in architecture.DTYPES}


class CausalLM(Protocol):
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [T, hidden] of the flat batch."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for N hidden rows."""

    def map_weight(self, name: str, tensor: torch.Tensor) -> tuple[str, int, torch.Tensor] | None:
        """Checkpoint tensor -> (parameter name, first row it fills, tensor); None to skip it."""

    def choose_kernels(self, requested: str) -> str:
        """Pick the kernels engine.kernels asks for (auto, native, torch); returns which, and why.
        Raises NativeUnavailable when native was asked for and cannot run."""

    def use_kernels(self, requested: str) -> str:
        """choose_kernels, and run on the loaded weights prepared for them."""

    def kernel_forms(self, meta: bool = False) -> Iterator[tuple[str, Form]]:
        """Each parameter in the form the kernels read it (kernel_forms.py)."""

    def use_forms(self, forms: dict[str, Form]) -> None:
        """Run on these forms, wherever they are held."""


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer
    name: str
    dtype: torch.dtype
    vocab_size: int
    max_model_len: int  # config.max_model_len, capped by what the model can attend over
    kernels_reason: str  # which kernels it runs on, and why (choose_kernels)


def fill_weights(model: CausalLM, name: str, kernels: str, resident, read: Callable[[], None]) -> str:
    """Give the skeleton model its weights in the form the kernels engine.kernels = kernels
    picks read: a dead predecessor's from resident (a ResidentWeights: engine/resident_weights.py),
    else read() and prepared (kept in resident's region when there is one). Returns the
    kernels' reason."""
    reason = model.choose_kernels(kernels)
    if resident is not None and resident.attach(model, name):
        return reason
    with torch.no_grad():
        read()
    if resident is not None:
        resident.keep(model)
    else:
        model.use_forms(dict(model.kernel_forms()))
    return reason


def load_checkpoint(config: ModelConfig, device: torch.device, kernels: str = "torch", resident=None) -> LoadedModel:
    """kernels: engine.kernels; resident: see fill_weights (with weights there, no weight file
    is read)."""
    path = Path(config.path)
    model, hf, dtype, vocab_size, model_len = skeleton(config, device)
    reason = fill_weights(model, path.name, kernels, resident,
                          lambda: copy_weights(model, _tensors(_weight_files(path)), path))
    try:
        tokenizer = HFTokenizer(path, eos_token_ids(path, hf))
    except ValueError as e:   # a tokenizer file the worker cannot take: tokenizer.py names it
        raise UnsupportedModel(str(e)) from None
    return LoadedModel(model, tokenizer, path.name, dtype, vocab_size, min(config.max_model_len, model_len), reason)


def skeleton(config: ModelConfig, device: torch.device) -> tuple[nn.Module, dict, torch.dtype, int, int]:
    """The model config describes (a checkpoint's, or the embedded one where config.path is
    empty) with its parameters' memory on the device, not yet filled; its config.json ({} for
    the embedded model), dtype, vocabulary size and context length."""
    arch = architecture.of(config, device.type)
    with torch.device("meta"):  # parameters get memory below: no time spent on random init
        if isinstance(arch.args, LlamaArgs):
            model = LlamaForCausalLM(arch.args, device)
        elif isinstance(arch.args, GemmaArgs):
            model = GemmaForCausalLM(arch.args, device)
        else:
            model = GPT2LMHeadModel(arch.args)
    model = on_device(model.to(DTYPES[arch.dtype]), device).eval().requires_grad_(False)
    if arch.quantization == "int8":
        int8.use_int8(model)
    for name, form in arch.hf.get(gguf_file.KEPT_QUANTIZED, {}).items():   # a GGUF's quantized matrices
        module_name = name.removesuffix(".weight")
        if isinstance(form, tuple):   # parts of different forms
            split = split_linear.split(model, module_name, tuple(rows for _, rows in form))
            for part, (part_form, _) in zip(split.parts, form):
                _hold(part, part_form)
        else:
            _hold(model.get_submodule(module_name), form)
    return model, arch.hf, DTYPES[arch.dtype], arch.vocab_size, arch.model_len


def _hold(module: nn.Module, form: str) -> None:
    """Give module's weight the memory of a GGUF form (int8 in the file's groups, or 4-bit)."""
    if form == "int8":
        int8.hold_int8(module, GGUF_GROUP)
    else:
        int4.hold_int4(module, form)


def on_device(model: nn.Module, device: torch.device) -> nn.Module:
    """nn.Module.to_empty, with torch.empty of each parameter's shape and dtype in place of
    torch.empty_like: empty_like of a meta tensor runs torch's Python reference, whose first use
    imports sympy (a heavy import, in every worker and standby that built a skeleton).
    A skeleton's parameters are contiguous, so the layout is the same."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():  # sharded: trust the index, not a glob (Mistral repos add consolidated.safetensors)
        return [path / name for name in _shard_names(index)]
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModel(f"{path}: no *.safetensors weights (pytorch_model.bin is not supported)")
    return files


def _shard_names(index: Path) -> list[str]:
    """The files an index's weight_map names: file names in its directory, never a path (an
    absolute one, or one with ..) that would take the loader elsewhere."""
    weight_map = read_json(index).get("weight_map")
    names = set(weight_map.values()) if isinstance(weight_map, dict) else set()
    if not names or not all(isinstance(name, str) and name == Path(name).name and name not in ("", "..")
                            for name in names):
        raise UnsupportedModel(f"{index}: weight_map {weight_map!r:.200} is not an object of tensor names "
                               "to file names beside it")
    return sorted(names)


def _tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each file's tensors. safetensors refuses a header that lies (offsets past the end, a
    length of 2^60, an unknown dtype) before it allocates; its refusal is named with the file."""
    for file in files:
        try:
            if not stat.S_ISREG(os.stat(file).st_mode):   # a FIFO would block the open
                raise UnsupportedModel(f"{file}: not a regular file")
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise UnsupportedModel(f"{file}: not a readable safetensors file ({e})") from None


def copy_weights(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]], path: Path) -> None:
    """Fill model's parameters from (checkpoint name, tensor) pairs; float matrices for int8
    parameters are quantized on the way (int8.quantize), int8 ones copied with their scales."""
    params = dict(model.named_parameters())
    filled = dict.fromkeys(params, 0)
    for name, tensor in tensors:
        mapped = model.map_weight(name, tensor)
        if mapped is None:
            continue
        target, row, tensor = mapped
        if target not in params:
            raise UnsupportedModel(f"{path}: unexpected tensor {name!r} for this architecture")
        param = params[target]
        if target.endswith(int8.SCALE_SUFFIX) and tensor.dim() == 1:
            tensor = tensor[:, None].expand(-1, param.shape[1])   # one scale a row: each group takes it
        if (tensor.dim() != param.dim() or row + tensor.shape[0] > param.shape[0]
                or tensor.shape[1:] != param.shape[1:]):
            raise UnsupportedModel(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, which does "
                                   f"not fit {target} {tuple(param.shape)} as config.json describes it")
        tensor = _as_parameter_type(name, tensor, param, target, row, params, filled, path)
        param.narrow(0, row, tensor.shape[0]).copy_(tensor)  # also casts to the model dtype
        filled[target] += tensor.numel()
    missing = [name for name, param in params.items() if filled[name] != param.numel()]
    if missing:
        raise UnsupportedModel(f"{path}: checkpoint lacks weights for {', '.join(missing[:5])}"
                               + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def _as_parameter_type(name: str, tensor: torch.Tensor, param: torch.Tensor, target: str, row: int, params: dict,
                       filled: dict, path: Path) -> torch.Tensor:
    """tensor as param takes it: a float matrix quantized for an int8 parameter (its scales
    written into target's scale parameter); int8 only into int8, scales only if usable."""
    if param.dtype == torch.int8 and tensor.is_floating_point():
        tensor, scales = int8.quantize(tensor)
        scale_name = target + int8.SCALE_SUFFIX
        params[scale_name].narrow(0, row, scales.shape[0]).copy_(scales)
        filled[scale_name] += scales.numel()
    elif ((param.dtype == torch.int8) != (tensor.dtype == torch.int8)
          or (param.is_floating_point() and not tensor.is_floating_point())):   # an int64 or bool tensor, say
        hint = " (an int8 checkpoint: set model.quantization = \"int8\")" if tensor.dtype == torch.int8 else ""
        raise UnsupportedModel(f"{path}: tensor {name!r} is {tensor.dtype}, {target} takes {param.dtype}{hint}")
    elif target.endswith(int8.SCALE_SUFFIX) and (reason := int8.bad_scales(tensor)):
        raise UnsupportedModel(f"{path}: tensor {name!r}: {reason}")
    return tensor
