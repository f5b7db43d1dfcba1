"""Load a causal LM from a local Hugging Face directory: config.json, *.safetensors, tokenizer.json.

Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, GPT2LMHeadModel in float32,
float16 or bfloat16. Everything else is refused up front with UnsupportedModel naming the exact
feature, rather than loading and then generating garbage.

dtype "auto" means the checkpoint's own dtype, except that half-precision checkpoints run in
float32 on the CPU: CPU float16/bfloat16 matmul kernels are several times slower than float32 ones,
so there the memory saving would cost most of the speed. Ask for bfloat16 explicitly to get it.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from torch import nn

from mcpd.config import ModelConfig
from mcpd.models import int8
from mcpd.models.gpt2 import GPT2Args, GPT2LMHeadModel
from mcpd.models.kernel_forms import Form
from mcpd.models.layers import AttentionMetadata, Llama3RopeScaling
from mcpd.models.llama import LlamaArgs, LlamaForCausalLM
from mcpd.tokenizer import HFTokenizer, Tokenizer, eos_token_ids

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class UnsupportedModel(ValueError):
    """A checkpoint mcpd cannot run; the message names the architecture, feature or file."""


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
    tokenizer = HFTokenizer(path, eos_token_ids(path, hf))
    return LoadedModel(model, tokenizer, path.name, dtype, vocab_size, min(config.max_model_len, model_len), reason)


def skeleton(config: ModelConfig, device: torch.device) -> tuple[nn.Module, dict, torch.dtype, int, int]:
    """The checkpoint's model with its parameters' memory on the device, not yet filled; its
    config.json, dtype, vocabulary size and context length."""
    path = Path(config.path)
    hf = _read_json(path / "config.json")
    if "quantization_config" in hf:
        method = hf["quantization_config"].get("quant_method", "unknown")
        raise UnsupportedModel(f"{path}: quantized checkpoints are not supported ({method})")
    architecture = (hf.get("architectures") or ["<none>"])[0]
    build = ARCHITECTURES.get(architecture)
    if build is None:
        raise UnsupportedModel(f"{path}: architecture {architecture!r} is not supported "
                               f"(supported: {', '.join(ARCHITECTURES)})")
    if not (path / "tokenizer.json").exists():
        raise UnsupportedModel(f"{path}: no tokenizer.json (a sentencepiece tokenizer.model alone is not supported)")
    dtype = resolve_dtype(config.dtype, hf.get("torch_dtype") or hf.get("dtype"), device)
    try:
        with torch.device("meta"):  # parameters get memory below: no time spent on random init
            model, vocab_size, model_len = build(hf, architecture, device)
    except KeyError as e:
        raise UnsupportedModel(f"{path / 'config.json'} lacks {e.args[0]!r}, needed for {architecture}") from None
    model = on_device(model.to(dtype), device).eval().requires_grad_(False)
    quantize_skeleton(model, config.quantization, path)
    return model, hf, dtype, vocab_size, model_len


def on_device(model: nn.Module, device: torch.device) -> nn.Module:
    """nn.Module.to_empty, with torch.empty of each parameter's shape and dtype in place of
    torch.empty_like: empty_like of a meta tensor runs torch's Python reference, whose first use
    imports sympy (0.3-0.4 s of CPU in every worker, pool keeper and standby that built a skeleton).
    A skeleton's parameters are contiguous, so the layout is the same."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def quantize_skeleton(model: nn.Module, quantization: str, path: Path) -> None:
    """Make model's linear layers int8 (int8.use_int8) when model.quantization asks for it."""
    if quantization == "none":
        return
    if not isinstance(model, LlamaForCausalLM):
        raise UnsupportedModel(f"{path}: quantization {quantization!r} is for the Llama family only")
    int8.use_int8(model)


def resolve_dtype(requested: str, checkpoint: str | None, device: torch.device) -> torch.dtype:
    if requested != "auto":
        return DTYPES[requested]
    dtype = DTYPES.get(checkpoint or "float32")
    if dtype is None:
        raise UnsupportedModel(f"checkpoint dtype {checkpoint!r} (supported: {', '.join(DTYPES)})")
    return torch.float32 if device.type == "cpu" else dtype


def _build_llama(hf: dict, architecture: str, device: torch.device):
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"{architecture}: hidden_act {act!r} (supported: silu)")
    # transformers 5 writes rope_parameters (with rope_theta inside); older configs rope_scaling.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    max_positions = hf.get("max_position_embeddings", 2048)
    if rope_type == "llama3":
        scaling = Llama3RopeScaling(rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                                    rope.get("original_max_position_embeddings", max_positions))
    elif rope_type == "default":
        scaling = None
    else:
        raise UnsupportedModel(f"{architecture}: rope type {rope_type!r} (supported: default, llama3)")
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModel(f"{architecture}: partial_rotary_factor (rotary on part of each head)")
    qwen2 = architecture == "Qwen2ForCausalLM"
    attention_bias = hf.get("attention_bias", False)
    heads = hf["num_attention_heads"]
    args = LlamaArgs(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)), rope_scaling=scaling,
        qkv_bias=qwen2 or attention_bias, o_bias=attention_bias and not qwen2,
        mlp_bias=hf.get("mlp_bias", False), tie_embeddings=hf.get("tie_word_embeddings", False))
    # Attention is always full here. Within a sliding window full attention is the same thing, so
    # the window caps the usable length instead of making the model unusable.
    window = _sliding_window(hf, qwen2)
    model_len = min(max_positions, window) if window else max_positions
    return LlamaForCausalLM(args, device), args.vocab_size, model_len


def _sliding_window(hf: dict, qwen2: bool) -> int | None:
    if qwen2 and not hf.get("use_sliding_window", False):
        return None
    layer_types = hf.get("layer_types")
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return hf.get("sliding_window")


def _build_gpt2(hf: dict, architecture: str, device: torch.device):
    act = hf.get("activation_function", "gelu_new")
    approximate = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}.get(act)
    if approximate is None:
        raise UnsupportedModel(f"{architecture}: activation_function {act!r} (supported: gelu_new, gelu)")
    if hf.get("add_cross_attention"):
        raise UnsupportedModel(f"{architecture}: add_cross_attention (encoder-decoder GPT-2)")
    args = GPT2Args(
        vocab_size=hf["vocab_size"], hidden_size=hf["n_embd"], num_layers=hf["n_layer"],
        num_heads=hf["n_head"], inner_size=hf.get("n_inner") or 4 * hf["n_embd"],
        max_positions=hf["n_positions"], layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        gelu_approximate=approximate, scale_attn_weights=hf.get("scale_attn_weights", True),
        scale_attn_by_inverse_layer_idx=hf.get("scale_attn_by_inverse_layer_idx", False))
    return GPT2LMHeadModel(args), args.vocab_size, args.max_positions


ARCHITECTURES = {
    "LlamaForCausalLM": _build_llama,
    "MistralForCausalLM": _build_llama,
    "Qwen2ForCausalLM": _build_llama,
    "GPT2LMHeadModel": _build_gpt2,
}


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():  # sharded: trust the index, not a glob (Mistral repos add consolidated.safetensors)
        return [path / name for name in sorted(set(_read_json(index)["weight_map"].values()))]
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModel(f"{path}: no *.safetensors weights (pytorch_model.bin is not supported)")
    return files


def _tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


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
    elif (param.dtype == torch.int8) != (tensor.dtype == torch.int8):
        hint = " (an int8 checkpoint: set model.quantization = \"int8\")" if tensor.dtype == torch.int8 else ""
        raise UnsupportedModel(f"{path}: tensor {name!r} is {tensor.dtype}, {target} takes {param.dtype}{hint}")
    elif target.endswith(int8.SCALE_SUFFIX) and (reason := int8.bad_scales(tensor)):
        raise UnsupportedModel(f"{path}: tensor {name!r}: {reason}")
    return tensor


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UnsupportedModel(f"{path} is missing") from None
    except json.JSONDecodeError as e:
        raise UnsupportedModel(f"{path}: not valid JSON ({e})") from None
