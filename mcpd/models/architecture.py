"""A model's architecture as its checkpoint's config.json describes it (or the embedded model's,
fixed here): the arguments its module is built from, the dtype it runs in, its vocabulary and
context length, read without torch.

The loader builds its skeleton from this (loader.skeleton), and the pool keeper sizes a pool
from it (parameter_table.py) without torch (a second of CPU at every start). Every refusal of a
checkpoint's description is made here, so both meet the same UnsupportedModel, in the same order.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from mcpd import gguf_file, small_file, tokenizer
from mcpd.config import EMBEDDED_PATH, Config, ConfigError, ModelConfig
from mcpd.models import config_fields, model_sizes, rope_scaling
from mcpd.models.model_sizes import MAX_EXPERTS, MAX_MODEL_LEN, SIZE_CAPS
from mcpd.models.rope_scaling import RopeScaling
from mcpd.tokenizer import ByteTokenizer

DTYPES = ("float32", "float16", "bfloat16")   # the dtypes a model runs in (loader.DTYPES: torch's)
EMBEDDED_NAME = "mcpd-embedded-llama"


class UnsupportedModel(ValueError):
    """A checkpoint mcpd cannot run; the message names the architecture, feature or file."""


@dataclass(frozen=True)
class DecoderSizes:
    """What every RMSNorm decoder family (Llama's, Gemma's) is sized by."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float


@dataclass(frozen=True)
class LlamaArgs(DecoderSizes):
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False      # Qwen2, or Llama's attention_bias
    o_bias: bool = False        # Llama's attention_bias only
    mlp_bias: bool = False
    tie_embeddings: bool = False
    sliding_window: int | None = None   # each query of a windowed layer sees itself and window - 1 keys before
    sliding_layers: tuple[int, ...] = ()   # the layers with the window
    qk_norm: bool = False       # Qwen3: an RMSNorm over each head of the queries and keys, before rope
    num_experts: int = 0        # Mixtral: a mixture of this many experts in place of each MLP
    experts_per_token: int = 0


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
    tie_embeddings: bool = True      # False: the checkpoint holds its own lm_head.weight


@dataclass(frozen=True)
class GemmaArgs(DecoderSizes):
    """Gemma 2 and Gemma 3 (text): (1 + weight) RMSNorms before and after attention and the MLP,
    GeGLU, the embedding scaled by sqrt(hidden), local (sliding-window) layers between global ones,
    each kind with its own rope; Gemma 2 soft-caps attention scores and logits, Gemma 3 normalises
    each query and key head instead."""
    query_pre_attn_scalar: float            # scores are scaled by its inverse square root
    sliding_window: int | None
    sliding_layers: tuple[int, ...]
    global_rope_theta: float
    local_rope_theta: float
    global_rope_scaling: RopeScaling | None = None
    local_rope_scaling: RopeScaling | None = None
    attn_softcap: float | None = None       # scores -> tanh(scores / cap) * cap
    final_softcap: float | None = None      # logits alike
    qk_norm: bool = False
    tie_embeddings: bool = True


ModelArgs = LlamaArgs | GPT2Args | GemmaArgs

# The embedded default model (embedded.py): a small Llama, with GQA.
EMBEDDED_ARGS = LlamaArgs(vocab_size=ByteTokenizer.vocab_size, hidden_size=256, intermediate_size=704,
                          num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5,
                          rope_theta=10000.0)


@dataclass(frozen=True)
class Architecture:
    args: ModelArgs
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
    except config_fields.BadField as e:
        raise UnsupportedModel(f"{path / 'config.json'}: {e}") from None
    except (TypeError, ValueError, AttributeError, ArithmeticError) as e:   # a lie not foreseen in config_fields' reads
        raise UnsupportedModel(f"{path / 'config.json'}: unusable values ({e})") from None


def _field_names(args: ModelArgs) -> dict[str, str]:
    """config.json's names of the fields its family's args rename (model_sizes.check)."""
    if isinstance(args, GPT2Args):
        return model_sizes.GPT2_NAMES
    return model_sizes.GEMMA_NAMES if isinstance(args, GemmaArgs) else model_sizes.DECODER_NAMES


def is_embedded(path: str) -> bool:
    return path in ("", EMBEDDED_PATH)


def _of_gguf(config: ModelConfig, path: Path, device_type: str) -> Architecture:
    """A GGUF file's model (gguf_architecture.py), checked as a checkpoint's is; its hf dict
    holds what the loader and the tokenizer want to know of the file."""
    from mcpd.models import gguf_architecture

    try:
        metadata = gguf_file.open_gguf(path)
        found, vocab_size, model_len, name = gguf_architecture.llama_args(metadata)
        scaling = found.pop("rope_scaling")
        args = LlamaArgs(**found, rope_scaling=rope_scaling.Llama3RopeScaling(*scaling) if scaling else None)
        _check_sizes(args, model_len, path, gguf_architecture.field_names(name))
        kept = gguf_architecture.check_tensors(metadata, args)   # and the matrices that stay quantized
    except UnsupportedModel:
        raise
    except gguf_file.BadGGUF as e:
        raise UnsupportedModel(f"{path}: {e}") from None
    except (TypeError, ValueError, ArithmeticError) as e:   # values that lie in a way not foreseen above
        raise UnsupportedModel(f"{path}: unusable metadata ({e})") from None
    quantization = _quantization(args, config.quantization, path)   # int8: every matrix requantized
    hf = {"gguf_architecture": name, gguf_file.KEPT_QUANTIZED: kept if quantization == "none" else {}}
    return Architecture(args, resolve_dtype(config.dtype, "float32", device_type), quantization, vocab_size, model_len, hf)


def _of_checkpoint(config: ModelConfig, hf: dict, path: Path, device_type: str) -> Architecture:
    config_path = path / "config.json"
    if "quantization_config" in hf:
        method = config_fields.mapping(hf, "quantization_config").get("quant_method", "unknown")
        raise UnsupportedModel(f"{path}: quantized checkpoints are not supported ({method!r:.100})")
    architecture = (config_fields.names(hf, "architectures") or ["<none>"])[0]
    read = ARCHITECTURES.get(architecture)
    if read is None:
        raise UnsupportedModel(f"{path}: architecture {architecture!r} is not supported "
                               f"(supported: {', '.join(ARCHITECTURES)})")
    if not (path / "tokenizer.json").exists():
        raise UnsupportedModel(f"{path}: no tokenizer.json (a sentencepiece tokenizer.model alone is not supported)")
    dtype_key = "torch_dtype" if hf.get("torch_dtype") else "dtype"
    dtype = resolve_dtype(config.dtype, hf.get(dtype_key), device_type, f"{config_path}: {dtype_key}")
    try:
        args, vocab_size, model_len = read(hf, architecture)
    except KeyError as e:
        raise UnsupportedModel(f"{config_path} lacks {e.args[0]!r}, needed for {architecture}") from None
    except (UnsupportedModel, rope_scaling.UnsupportedRope) as e:   # they name the field; the file is added here
        raise UnsupportedModel(f"{config_path}: {e}") from None
    except (TypeError, ZeroDivisionError) as e:   # a count that is not a number, or 0 heads
        raise UnsupportedModel(f"{config_path}: unusable sizes ({e})") from None
    _check_sizes(args, model_len, config_path, _field_names(args))
    args = _reachable_window(args, min(config.max_model_len, model_len))
    return Architecture(args, dtype, _quantization(args, config.quantization, path), vocab_size, model_len, hf)


def _check_sizes(args: ModelArgs, model_len, where: Path, names: dict[str, str]) -> None:
    """model_sizes.check, its refusal naming the file."""
    try:
        model_sizes.check(args, model_len, names)
    except (config_fields.BadField, rope_scaling.UnsupportedRope) as e:
        raise UnsupportedModel(f"{where}: {e}") from None


def check_configured(config: Config) -> None:
    """ConfigError where the model, or any version of [models] (loaded or not), is one mcpd cannot run. The
    supervisor asks at start and on reload (exit 2, or the running config kept), not each worker at every restart."""
    named = ([(f"models.{m}.versions.{v}", c) for m, e in config.models.items() for v, c in e.versions.items()]
             if config.models else [("model", config.model)])
    for key, model in named:
        try:
            of(model, "cpu")   # the device changes only what dtype "auto" resolves to, never a refusal
            _check_tokenizer(model)
        except ValueError as e:   # UnsupportedModel, or the tokenizer's
            raise ConfigError(f"{key}: {e}") from None
        finally:   # the supervisor keeps no file's metadata in memory: the children take it from the runtime dir
            gguf_file.forget()


def _check_tokenizer(model: ModelConfig) -> None:
    """A tokenizer the scheduler and workers could not build: built here as they build it (and
    dropped), and refused once, not at each restart (ValueError naming the file)."""
    tokenizer.load(model)


def resolve_dtype(requested: str, checkpoint: str | None, device_type: str, source: str = "checkpoint dtype") -> str:
    """dtype "auto" is the checkpoint's own, except that half precision runs in float32 on the
    CPU (loader.py says why). source: where the checkpoint's is written, for the refusal."""
    if requested != "auto":
        return requested
    dtype = checkpoint or "float32"
    if dtype not in DTYPES:
        raise UnsupportedModel(f"{source} {checkpoint!r:.100} is not supported (supported: {', '.join(DTYPES)})")
    return "float32" if device_type == "cpu" else dtype


def _quantization(args: ModelArgs, quantization: str, path: Path) -> str:
    if quantization != "none" and not isinstance(args, LlamaArgs):
        raise UnsupportedModel(f"{path}: quantization {quantization!r} is for the Llama family only")
    if quantization != "none" and args.num_experts:
        raise UnsupportedModel(f"{path}: quantization {quantization!r} of a mixture of experts")
    return quantization


def _llama_args(hf: dict, architecture: str) -> tuple[LlamaArgs, int, int]:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"{architecture}: hidden_act {act!r} (supported: silu)")
    # transformers 5 writes rope_parameters (with rope_theta inside); older configs rope_scaling.
    rope = config_fields.mapping(hf, "rope_parameters") or config_fields.mapping(hf, "rope_scaling")
    if architecture == "Phi3ForCausalLM":
        rope = rope_scaling.phi3(rope)
    heads, head_dim, num_layers = config_fields.count(hf, "num_attention_heads"), _head_dim(hf), _num_layers(hf)
    max_positions = config_fields.count(hf, "max_position_embeddings", 2048, most=MAX_MODEL_LEN)
    scaling = rope_scaling.read(rope, hf, head_dim)
    qwen2 = architecture == "Qwen2ForCausalLM"
    attention_bias = config_fields.flag(hf, "attention_bias", False)
    args = LlamaArgs(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=num_layers,
        num_heads=heads, num_kv_heads=config_fields.count(hf, "num_key_value_heads", heads),
        head_dim=head_dim, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)), rope_scaling=scaling,
        qkv_bias=qwen2 or attention_bias, o_bias=attention_bias and not qwen2,
        mlp_bias=config_fields.flag(hf, "mlp_bias", False),
        tie_embeddings=config_fields.flag(hf, "tie_word_embeddings", False),
        qk_norm=architecture == "Qwen3ForCausalLM", **_experts(hf, architecture),
        **_sliding_window(hf, architecture, num_layers))
    return args, args.vocab_size, scaling.context_length(max_positions) if scaling else max_positions


def _head_dim(hf: dict) -> int:
    """config.json's head_dim; without one, hidden_size split evenly over num_attention_heads.
    Even: rope turns each head's dimensions in pairs."""
    head_dim = config_fields.count(hf, "head_dim", None)
    if head_dim is None:
        hidden, heads = config_fields.count(hf, "hidden_size"), config_fields.count(hf, "num_attention_heads")
        if hidden % heads:
            raise config_fields.BadField(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                                         "(and no head_dim)")
        head_dim = hidden // heads
    if head_dim % 2:
        raise config_fields.BadField(f"head_dim {head_dim} is odd (rope turns dimensions in pairs)")
    return head_dim


def _num_layers(hf: dict) -> int:
    """num_hidden_layers, held to its cap before a list of each layer's type is made."""
    return config_fields.count(hf, "num_hidden_layers", most=SIZE_CAPS["num_layers"])


def _sliding_window(hf: dict, architecture: str, num_layers: int) -> dict:
    """LlamaArgs' sliding_window and sliding_layers, as transformers reads them: Mistral and Phi-3
    window every layer; Qwen2 and Qwen3 only with use_sliding_window, the layers layer_types names
    (else those from max_window_layers on); Llama none."""
    window = hf.get("sliding_window")
    if architecture == "LlamaForCausalLM" or window is None:
        return {}
    if architecture in ("MistralForCausalLM", "Phi3ForCausalLM"):
        return {"sliding_window": window, "sliding_layers": tuple(range(num_layers))}
    if not config_fields.flag(hf, "use_sliding_window", False):
        return {}
    layer_types = hf.get("layer_types")
    if layer_types is None:
        first = config_fields.count(hf, "max_window_layers", 28, least=0)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    layers = _windowed_layers(layer_types, num_layers, architecture)
    return {"sliding_window": window, "sliding_layers": layers} if layers else {}


def _experts(hf: dict, architecture: str) -> dict:
    """LlamaArgs' num_experts and experts_per_token: Mixtral's, none for the others."""
    if architecture != "MixtralForCausalLM":
        return {}
    num_experts = config_fields.count(hf, "num_local_experts", most=MAX_EXPERTS)
    per_token = config_fields.count(hf, "num_experts_per_tok", most=num_experts)
    return {"num_experts": num_experts, "experts_per_token": per_token}


def _windowed_layers(layer_types, num_layers: int, architecture: str) -> tuple[int, ...]:
    """The indices of config.json's layer_types that say sliding_attention; UnsupportedModel where it
    is not one known type per layer."""
    if (not isinstance(layer_types, list) or len(layer_types) != num_layers
            or not all(isinstance(kind, str) for kind in layer_types)):
        raise UnsupportedModel(f"{architecture}: layer_types {layer_types!r:.200} is not a list of {num_layers} "
                               "layer types")
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise UnsupportedModel(f"{architecture}: layer_types {sorted(unknown)!r} "
                               "(supported: full_attention, sliding_attention)")
    return tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")


def _reachable_window(args: ModelArgs, model_len: int) -> ModelArgs:
    """args without a sliding window that no sequence of model_len tokens exceeds: within its
    window attention is full, which every kernel set runs (only the torch kernels have windows)."""
    if not isinstance(args, GPT2Args) and args.sliding_window is not None and args.sliding_window >= model_len:
        return dataclasses.replace(args, sliding_window=None, sliding_layers=())
    return args


def _gpt2_args(hf: dict, architecture: str) -> tuple[GPT2Args, int, int]:
    act = config_fields.text(hf, "activation_function", "gelu_new")
    approximate = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}.get(act)
    if approximate is None:
        raise UnsupportedModel(f"{architecture}: activation_function {act!r} (supported: gelu_new, gelu)")
    if config_fields.flag(hf, "add_cross_attention", False):
        raise UnsupportedModel(f"{architecture}: add_cross_attention (encoder-decoder GPT-2)")
    hidden, heads = config_fields.count(hf, "n_embd"), config_fields.count(hf, "n_head")
    if hidden % heads:
        raise config_fields.BadField(f"n_embd {hidden} is not a multiple of n_head {heads}")
    args = GPT2Args(
        vocab_size=hf["vocab_size"], hidden_size=hidden, num_layers=hf["n_layer"],
        num_heads=heads, inner_size=config_fields.count(hf, "n_inner", 4 * hidden),
        max_positions=hf["n_positions"], layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        gelu_approximate=approximate, scale_attn_weights=config_fields.flag(hf, "scale_attn_weights", True),
        scale_attn_by_inverse_layer_idx=config_fields.flag(hf, "scale_attn_by_inverse_layer_idx", False),
        tie_embeddings=config_fields.flag(hf, "tie_word_embeddings", True))
    return args, args.vocab_size, args.max_positions


def _gemma_args(hf: dict, architecture: str) -> tuple[GemmaArgs, int, int]:
    act = hf.get("hidden_activation") or hf.get("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModel(f"{architecture}: hidden_activation {act!r} (supported: gelu_pytorch_tanh)")
    for flag in ("attention_bias", "use_bidirectional_attention"):
        if config_fields.flag(hf, flag, False):
            raise UnsupportedModel(f"{architecture}: {flag}")
    gemma3 = architecture == "Gemma3ForCausalLM"
    num_layers, heads = _num_layers(hf), config_fields.count(hf, "num_attention_heads")
    head_dim = _head_dim(hf)
    every = config_fields.count(hf, "sliding_window_pattern", 6) if gemma3 else 2   # every n-th layer is global
    layer_types = hf.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                            for i in range(num_layers)]
    window = hf.get("sliding_window")
    global_rope, local_rope = rope_scaling.gemma_ropes(hf, gemma3)
    args = GemmaArgs(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_layers=num_layers, num_heads=heads, num_kv_heads=config_fields.count(hf, "num_key_value_heads", heads),
        head_dim=head_dim, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256), sliding_window=window,
        sliding_layers=_windowed_layers(layer_types, num_layers, architecture) if window else (),
        global_rope_theta=global_rope.get("rope_theta", 1_000_000.0 if gemma3 else 10_000.0),
        local_rope_theta=local_rope.get("rope_theta", 10_000.0),
        global_rope_scaling=rope_scaling.read(global_rope, hf, head_dim),
        local_rope_scaling=rope_scaling.read(local_rope, hf, head_dim),
        attn_softcap=hf.get("attn_logit_softcapping", None if gemma3 else 50.0),
        final_softcap=hf.get("final_logit_softcapping", None if gemma3 else 30.0),
        qk_norm=gemma3, tie_embeddings=config_fields.flag(hf, "tie_word_embeddings", True))
    max_positions = config_fields.count(hf, "max_position_embeddings", 8192, most=MAX_MODEL_LEN)
    scaling = args.global_rope_scaling
    return args, args.vocab_size, scaling.context_length(max_positions) if scaling else max_positions


ARCHITECTURES = {
    "LlamaForCausalLM": _llama_args,
    "MistralForCausalLM": _llama_args,
    "Qwen2ForCausalLM": _llama_args,
    "Qwen3ForCausalLM": _llama_args,
    "Phi3ForCausalLM": _llama_args,
    "MixtralForCausalLM": _llama_args,
    "Gemma2ForCausalLM": _gemma_args,
    "Gemma3ForCausalLM": _gemma_args,
    "GPT2LMHeadModel": _gpt2_args,
}


def read_json(path: Path) -> dict:
    """The JSON object in path; UnsupportedModel where it is missing, unreadable, not JSON or not an object."""
    try:   # a FIFO or /dev/zero must not stall the supervisor (reload too)
        loaded = small_file.read_json(path)
    except FileNotFoundError:
        raise UnsupportedModel(f"{path} is missing") from None
    except OSError as e:
        raise UnsupportedModel(f"{path}: cannot be read ({e.strerror})") from None
    except small_file.NotSmallFile as e:
        raise UnsupportedModel(f"{path}: not valid JSON ({e})") from None
    if not isinstance(loaded, dict):
        raise UnsupportedModel(f"{path}: not a JSON object")
    return loaded
