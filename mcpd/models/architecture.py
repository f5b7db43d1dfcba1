"""A model's architecture as its checkpoint's config.json describes it (or the embedded model's,
fixed here): the arguments its module is built from, the dtype it runs in, its vocabulary and
context length, read without torch.

The loader builds its skeleton from this (loader.skeleton), and the pool keeper sizes a pool
from it (parameter_table.py) without importing torch, which costs a CPU keeper about a second of
CPU at every start. Every refusal of a checkpoint's description is made here, so both meet the
same UnsupportedModel, in the same order.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from mcpd import gguf_file
from mcpd.config import EMBEDDED_PATH, Config, ConfigError, ModelConfig
from mcpd.tokenizer import ByteTokenizer

DTYPES = ("float32", "float16", "bfloat16")   # the dtypes a model runs in (loader.DTYPES: torch's)
EMBEDDED_NAME = "mcpd-embedded-llama"


class UnsupportedModel(ValueError):
    """A checkpoint mcpd cannot run; the message names the architecture, feature or file."""


@dataclass(frozen=True)
class Llama3RopeScaling:
    """rope_scaling of type "llama3" (Llama 3.1+): long wavelengths are slowed down by `factor`
    (layers.llama3_scaled)."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None = None
    qkv_bias: bool = False      # Qwen2, or Llama's attention_bias
    o_bias: bool = False        # Llama's attention_bias only
    mlp_bias: bool = False
    tie_embeddings: bool = False


@dataclass(frozen=True)
class GPT2Args:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    inner_size: int
    max_positions: int
    layer_norm_eps: float
    gelu_approximate: str            # "tanh" (gelu_new) or "none" (exact gelu)
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False


# The embedded default model (embedded.py): a small Llama, with GQA.
EMBEDDED_ARGS = LlamaArgs(vocab_size=ByteTokenizer.vocab_size, hidden_size=256, intermediate_size=704,
                          num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5,
                          rope_theta=10000.0)


@dataclass(frozen=True)
class Architecture:
    args: LlamaArgs | GPT2Args
    dtype: str            # one of DTYPES: what its parameters are cast to
    quantization: str     # model.quantization: "int8" only for the Llama family
    vocab_size: int
    model_len: int        # the context length the model can attend over
    hf: dict = field(default_factory=dict)   # its config.json; {} for the embedded model


def of(config: ModelConfig, device_type: str) -> Architecture:
    """The architecture of the model config.path holds (the embedded one where it is empty), run
    on a device of device_type ("cpu", "cuda"); UnsupportedModel where mcpd cannot run it."""
    if is_embedded(config.path):
        return Architecture(EMBEDDED_ARGS, resolve_dtype(config.dtype, "float32", device_type), config.quantization,
                            EMBEDDED_ARGS.vocab_size, config.max_model_len)
    path = Path(config.path)
    if gguf_file.is_gguf(config.path):
        return _of_gguf(config, path, device_type)
    hf = read_json(path / "config.json")
    try:
        return _of_checkpoint(config, hf, path, device_type)
    except UnsupportedModel:
        raise
    except (TypeError, ValueError, AttributeError) as e:   # a value of the wrong type: a list for a name, say
        raise UnsupportedModel(f"{path / 'config.json'}: unusable values ({e})") from None


def is_embedded(path: str) -> bool:
    return path in ("", EMBEDDED_PATH)


def _of_gguf(config: ModelConfig, path: Path, device_type: str) -> Architecture:
    """A GGUF file's model (gguf_architecture.py), checked as a checkpoint's is; its hf dict
    holds what the loader and the tokenizer want to know of the file."""
    from mcpd.models import gguf_architecture

    try:
        reader = gguf_file.open_gguf(path)
        found, vocab_size, model_len, name = gguf_architecture.llama_args(reader)
        scaling = found.pop("rope_scaling")
        args = LlamaArgs(**found, rope_scaling=Llama3RopeScaling(*scaling) if scaling else None)
        _check_sizes(args, model_len, path)
        gguf_architecture.check_tensors(reader, args)
    except UnsupportedModel:
        raise
    except gguf_file.BadGGUF as e:
        raise UnsupportedModel(f"{path}: {e}") from None
    except (TypeError, ValueError, ArithmeticError) as e:   # values that lie in a way not foreseen above
        raise UnsupportedModel(f"{path}: unusable metadata ({e})") from None
    dtype = resolve_dtype(config.dtype, "float32", device_type)   # dequantized to float32 unless asked
    return Architecture(args, dtype, _quantization(args, config.quantization, path), vocab_size, model_len,
                        {"gguf_architecture": name})


def _of_checkpoint(config: ModelConfig, hf: dict, path: Path, device_type: str) -> Architecture:
    if "quantization_config" in hf:
        method = hf["quantization_config"].get("quant_method", "unknown")
        raise UnsupportedModel(f"{path}: quantized checkpoints are not supported ({method})")
    architecture = (hf.get("architectures") or ["<none>"])[0]
    read = ARCHITECTURES.get(architecture)
    if read is None:
        raise UnsupportedModel(f"{path}: architecture {architecture!r} is not supported "
                               f"(supported: {', '.join(ARCHITECTURES)})")
    if not (path / "tokenizer.json").exists():
        raise UnsupportedModel(f"{path}: no tokenizer.json (a sentencepiece tokenizer.model alone is not supported)")
    dtype = resolve_dtype(config.dtype, hf.get("torch_dtype") or hf.get("dtype"), device_type)
    try:
        args, vocab_size, model_len = read(hf, architecture)
    except KeyError as e:
        raise UnsupportedModel(f"{path / 'config.json'} lacks {e.args[0]!r}, needed for {architecture}") from None
    except (TypeError, ZeroDivisionError) as e:   # a count that is not a number, or 0 heads
        raise UnsupportedModel(f"{path / 'config.json'}: unusable sizes ({e})") from None
    _check_sizes(args, model_len, path / "config.json")
    return Architecture(args, dtype, _quantization(args, config.quantization, path), vocab_size, model_len, hf)


# The largest value each count may have. A config.json is a file an operator was handed: a
# layer count of 10^9 or a vocabulary of 2^62 must be refused with its name, not make the pool
# keeper list a billion parameters or the loader build them. The caps are far above any model
# mcpd could hold in memory (Llama 3.1 405B: 126 layers, hidden 16384, vocab 128256).
SIZE_CAPS = {"vocab_size": 1 << 22, "hidden_size": 1 << 17, "intermediate_size": 1 << 19, "num_layers": 1 << 12,
             "num_heads": 1 << 12, "num_kv_heads": 1 << 12, "head_dim": 1 << 12, "inner_size": 1 << 19,
             "max_positions": 1 << 24}
MAX_MODEL_LEN = 1 << 24
REALS = ("rms_norm_eps", "layer_norm_eps", "rope_theta")   # must be finite and positive


def _check_sizes(args: LlamaArgs | GPT2Args, model_len, config_path: Path) -> None:
    """UnsupportedModel naming the first count of args that is not a whole number within its
    cap, or real that is not finite and positive, or query heads not shared evenly by KV heads."""
    scaling = getattr(args, "rope_scaling", None)
    counts = [(name, getattr(args, name)) for name in SIZE_CAPS if hasattr(args, name)]
    counts.append(("context length", model_len))
    reals = [(name, getattr(args, name)) for name in REALS if hasattr(args, name)]
    if scaling is not None:
        counts.append(("rope original_max_position_embeddings", scaling.original_max_position_embeddings))
        reals += [(f"rope {name}", getattr(scaling, name))
                  for name in ("factor", "low_freq_factor", "high_freq_factor")]
    for name, value in counts:
        cap = SIZE_CAPS.get(name, MAX_MODEL_LEN)
        if type(value) is not int or not 1 <= value <= cap:
            raise UnsupportedModel(f"{config_path}: {name} {value!r} is not a whole number from 1 to {cap}")
    for name, value in reals:
        if type(value) not in (int, float) or not 0 < value < math.inf:
            raise UnsupportedModel(f"{config_path}: {name} {value!r} is not a finite positive number")
    if isinstance(args, LlamaArgs) and args.num_heads % args.num_kv_heads:
        raise UnsupportedModel(f"{config_path}: {args.num_heads} query heads cannot share "
                               f"{args.num_kv_heads} KV heads evenly")


def check_configured(config: Config) -> None:
    """ConfigError where the model, or any version of [models] (loaded or not), is one mcpd cannot
    run. The supervisor asks at start and on reload: found there it stops the start (exit 2) or
    keeps the running config; found by a worker it would fail and restart every 30 s."""
    named = ([(f"models.{m}.versions.{v}", c) for m, e in config.models.items() for v, c in e.versions.items()]
             if config.models else [("model", config.model)])
    for key, model in named:
        try:
            of(model, "cpu")   # the device changes only what dtype "auto" resolves to, never a refusal
            if gguf_file.is_gguf(model.path):
                _check_gguf_tokenizer(Path(model.path))
        except UnsupportedModel as e:
            raise ConfigError(f"{key}: {e}") from None


def _check_gguf_tokenizer(path: Path) -> None:
    """A GGUF's tokenizer is built from its metadata by the scheduler and every worker: one it
    cannot build is refused here, once, rather than by each of them at every restart."""
    from mcpd import gguf_tokenizer

    try:
        gguf_tokenizer.build(gguf_file.open_gguf(path))
    except gguf_file.BadGGUF as e:
        raise UnsupportedModel(f"{path}: {e}") from None


def resolve_dtype(requested: str, checkpoint: str | None, device_type: str) -> str:
    """dtype "auto" is the checkpoint's own, except that half precision runs in float32 on the
    CPU (loader.py says why)."""
    if requested != "auto":
        return requested
    dtype = checkpoint or "float32"
    if dtype not in DTYPES:
        raise UnsupportedModel(f"checkpoint dtype {checkpoint!r} (supported: {', '.join(DTYPES)})")
    return "float32" if device_type == "cpu" else dtype


def _quantization(args: LlamaArgs | GPT2Args, quantization: str, path: Path) -> str:
    if quantization != "none" and not isinstance(args, LlamaArgs):
        raise UnsupportedModel(f"{path}: quantization {quantization!r} is for the Llama family only")
    return quantization


def _llama_args(hf: dict, architecture: str) -> tuple[LlamaArgs, int, int]:
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
    return args, args.vocab_size, model_len


def _sliding_window(hf: dict, qwen2: bool) -> int | None:
    if qwen2 and not hf.get("use_sliding_window", False):
        return None
    layer_types = hf.get("layer_types")
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return hf.get("sliding_window")


def _gpt2_args(hf: dict, architecture: str) -> tuple[GPT2Args, int, int]:
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
    return args, args.vocab_size, args.max_positions


ARCHITECTURES = {
    "LlamaForCausalLM": _llama_args,
    "MistralForCausalLM": _llama_args,
    "Qwen2ForCausalLM": _llama_args,
    "GPT2LMHeadModel": _gpt2_args,
}


def read_json(path: Path) -> dict:
    """The JSON object in path; UnsupportedModel where it is missing, unreadable (a directory, no
    permission), not JSON (or not UTF-8, or a number past Python's 4300 digits) or not an object."""
    try:
        loaded = json.loads(path.read_text())
    except FileNotFoundError:
        raise UnsupportedModel(f"{path} is missing") from None
    except OSError as e:
        raise UnsupportedModel(f"{path}: cannot be read ({e.strerror})") from None
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError, the integer digit limit
        raise UnsupportedModel(f"{path}: not valid JSON ({e})") from None
    if not isinstance(loaded, dict):
        raise UnsupportedModel(f"{path}: not a JSON object")
    return loaded
