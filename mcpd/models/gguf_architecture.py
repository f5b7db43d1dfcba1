"""A GGUF file's model as mcpd builds it: the arguments of its LlamaArgs from its metadata
(llama.cpp's key names; architecture.py builds them), and every tensor's name, shape and type
checked against them before anything is allocated. Free of torch, as architecture.py.

Names map onto the Hugging Face ones the engine's models take (llama.py's map_weight), so a GGUF
fills the same parameters a checkpoint directory does (gguf_loader.py).
"""
from __future__ import annotations

import math
import re

from gguf.constants import GGML_QUANT_SIZES

from mcpd.bad_gguf import BadGGUF
from mcpd.gguf_file import value

ARCHITECTURES = ("llama", "qwen2")   # Mistral-style files say llama
# The tensor types read here: KEPT ones stay so in memory, the others are dequantized at load
# to the model's dtype (gguf_loader.py).
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
KEPT = {"Q8_0": "int8", "Q5_0": "int8", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q4_K": "q4_k",
        "Q6_K": "q6_k"}   # type -> the form that holds it (quant/): Q5_0's weights are integers in [-16, 15]
_PIECES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")   # a fused matrix's pieces, in its row order
_FUSED = ((re.compile(r"\.[qkv]_proj\."), ".qkv_proj."), (re.compile(r"\.(gate|up)_proj\."), ".gate_up_proj."))
ROPE_FREQS = "rope_freqs.weight"   # Llama 3.1's rope scaling, as llama.cpp's converter writes it
LLAMA3_ORIGINAL_LEN = 8192         # Llama 3's context length before scaling, where the file names none

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(name: str) -> str | None:
    """The Hugging Face name of GGUF tensor `name`; None for one this file has no place for."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    match = _BLOCK.fullmatch(name)
    if match is None:
        return None
    layer, part, kind = match.groups()
    mapped = _LAYER.get(f"{part}.{kind}") or (_LAYER.get(part) and f"{_LAYER[part]}.{kind}")
    return mapped and f"model.layers.{int(layer)}.{mapped}"


def llama_args(metadata) -> tuple[dict, int, int, str]:
    """(LlamaArgs' keyword arguments, rope_scaling as Llama3RopeScaling's arguments or None;
    vocabulary size, context length, architecture name); BadGGUF where the file's architecture
    is not one mcpd runs or a value is missing or of the wrong type."""
    arch = value(metadata, "general.architecture", str)
    if arch not in ARCHITECTURES:
        raise BadGGUF(f"architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    tensors = {t.name: t for t in metadata.tensors}

    def key(name, kind=int, default=None):
        got = value(metadata, f"{arch}.{name}", kind, default)
        if got is None:
            raise BadGGUF(f"metadata lacks {arch}.{name}")
        return got

    hidden, heads = key("embedding_length"), key("attention.head_count")
    if "token_embd.weight" not in tensors:
        raise BadGGUF("no token_embd.weight tensor")
    embedding_rows = int(tensors["token_embd.weight"].shape[-1])
    head_dim = key("attention.key_length", int, hidden // heads if heads else 0)
    theta = key("rope.freq_base", float, 10000.0)
    args = dict(
        vocab_size=key("vocab_size", int, embedding_rows), hidden_size=hidden,
        intermediate_size=key("feed_forward_length"), num_layers=key("block_count"),
        num_heads=heads, num_kv_heads=key("attention.head_count_kv", int, heads), head_dim=head_dim,
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", float), rope_theta=theta,
        rope_scaling=_llama3_scaling(metadata, arch, tensors.get(ROPE_FREQS), head_dim, theta),
        qkv_bias=arch == "qwen2", tie_embeddings="output.weight" not in tensors)
    return args, args["vocab_size"], key("context_length"), arch


def field_names(arch: str) -> dict[str, str]:
    """The metadata keys llama_args reads each size from, by model_sizes' names."""
    keys = {"vocab_size": "vocab_size", "hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
            "num_layers": "block_count", "num_heads": "attention.head_count", "num_kv_heads": "attention.head_count_kv",
            "head_dim": "attention.key_length", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
            "rope_theta": "rope.freq_base", "model_len": "context_length"}
    return {name: f"{arch}.{key}" for name, key in keys.items()}


def kept_quantized(metadata) -> dict[str, str | tuple[tuple[str, int], ...]]:
    """The engine's parameter name -> its form (KEPT's) for each matrix kept quantized: its GGUF
    tensors (q, k and v make one matrix, gate and up another) all of types KEPT has. A matrix
    whose pieces' forms differ (a Q4_K_M's Q6_K attn_v beside Q4_K q and k) is kept in parts:
    ((form, rows), ...), each run of pieces of one form in row order (gguf_file.KEPT_QUANTIZED)."""
    pieces: dict[str, list] = {}
    for tensor in metadata.tensors:
        name = hf_name(tensor.name)
        if name is not None:
            piece = (_piece_order(name), KEPT.get(tensor.tensor_type.name), int(tensor.shape[-1]))
            pieces.setdefault(fused_name(name), []).append(piece)
    kept = {}
    for name, listed in pieces.items():
        runs = _runs([(form, rows) for _, form, rows in sorted(listed, key=lambda piece: piece[0])])
        if all(form is not None for form, _ in runs):
            kept[name] = runs[0][0] if len(runs) == 1 else runs
    return kept


def _piece_order(name: str) -> int:
    """Where a Hugging Face tensor's rows go in its fused matrix, among the other pieces'."""
    projection = name.split(".")[-2]
    return _PIECES.index(projection) if projection in _PIECES else 0


def _runs(pieces: list[tuple[str | None, int]]) -> tuple[tuple[str | None, int], ...]:
    """(form, rows) of each run of consecutive pieces of one form."""
    runs = []
    for form, rows in pieces:
        if runs and runs[-1][0] == form:
            runs[-1] = (form, runs[-1][1] + rows)
        else:
            runs.append((form, rows))
    return tuple(runs)


def fused_name(name: str) -> str:
    """The engine's parameter a Hugging Face tensor `name` fills (llama.py fuses q/k/v, gate/up)."""
    for pattern, fused in _FUSED:
        name = pattern.sub(fused, name)
    return name


def check_tensors(metadata, args) -> dict[str, str]:
    """BadGGUF naming the first tensor that is missing, unexpected, of a type not read here, or
    of a shape other than args give it: before the skeleton is built from args. Returns
    kept_quantized(metadata)."""
    expected = dict(_checkpoint_shapes(args))
    seen = set()
    for tensor in metadata.tensors:
        name = hf_name(tensor.name)
        if tensor.name == ROPE_FREQS:
            continue
        if name is None or name not in expected:
            raise BadGGUF(f"unexpected tensor {tensor.name!r} for this architecture")
        if tensor.tensor_type.name not in TYPES:
            raise BadGGUF(f"tensor {tensor.name!r} has type {tensor.tensor_type.name} "
                          f"(supported: {', '.join(TYPES)})")
        shape = tuple(int(n) for n in reversed(tensor.shape))   # GGUF lists the fastest dimension first
        block = GGML_QUANT_SIZES[tensor.tensor_type][0]
        if shape[-1] % block:
            raise BadGGUF(f"tensor {tensor.name!r} has rows of {shape[-1]} values, not whole blocks of {block}")
        if shape != expected[name]:
            raise BadGGUF(f"tensor {tensor.name!r} has shape {shape}, the metadata gives {expected[name]}")
        seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise BadGGUF(f"no tensor for {', '.join(missing[:5])}" + (f" and {len(missing) - 5} more"
                                                                   if len(missing) > 5 else ""))
    return kept_quantized(metadata)


def _checkpoint_shapes(a):
    """(Hugging Face name, shape) of each tensor a checkpoint of args holds."""
    q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    yield "model.embed_tokens.weight", (a.vocab_size, a.hidden_size)
    yield "model.norm.weight", (a.hidden_size,)
    if not a.tie_embeddings:
        yield "lm_head.weight", (a.vocab_size, a.hidden_size)
    for i in range(a.num_layers):
        layer = f"model.layers.{i}."
        yield layer + "input_layernorm.weight", (a.hidden_size,)
        yield layer + "post_attention_layernorm.weight", (a.hidden_size,)
        for name, rows, columns in (("q_proj", q_size, a.hidden_size), ("k_proj", kv_size, a.hidden_size),
                                    ("v_proj", kv_size, a.hidden_size), ("o_proj", a.hidden_size, q_size)):
            yield f"{layer}self_attn.{name}.weight", (rows, columns)
            if a.qkv_bias and name != "o_proj":
                yield f"{layer}self_attn.{name}.bias", (rows,)
        for name, rows, columns in (("gate_proj", a.intermediate_size, a.hidden_size),
                                    ("up_proj", a.intermediate_size, a.hidden_size),
                                    ("down_proj", a.hidden_size, a.intermediate_size)):
            yield f"{layer}mlp.{name}.weight", (rows, columns)


def _llama3_scaling(metadata, arch: str, freqs, head_dim: int, theta: float) -> tuple | None:
    """Llama3RopeScaling's arguments (factor, low and high frequency factors, original length) for
    Llama 3.1's scaling from the per-frequency divisors llama.cpp's converter stores: the
    largest is the factor; the smoothed ones between fix where the smoothing starts and ends
    (only their ratio to the original length matters, so that length is taken as given)."""
    if freqs is None:
        return None
    if not 0 < theta < math.inf:
        raise BadGGUF(f"{arch}.rope.freq_base {theta!r} is not a finite positive number")
    if freqs.tensor_type.name != "F32" or int(freqs.n_elements) != head_dim // 2:
        raise BadGGUF(f"{ROPE_FREQS}: expected {head_dim // 2} F32 divisors, one per rotary frequency")
    divisors = [float(d) for d in metadata.data(freqs).reshape(-1)]
    if not all(math.isfinite(d) and d >= 1 for d in divisors):
        raise BadGGUF(f"{ROPE_FREQS}: divisors must be finite and >= 1")
    factor = max(divisors)
    if factor == 1:
        return None
    original = value(metadata, f"{arch}.rope.scaling.original_context_length", int, LLAMA3_ORIGINAL_LEN)
    wavelengths = [2 * math.pi * theta ** (2 * i / head_dim) for i in range(len(divisors))]
    smooth = [(w, (1 / d - 1 / factor) / (1 - 1 / factor)) for w, d in zip(wavelengths, divisors) if 1 < d < factor]
    if len(smooth) >= 2:   # smooth = original / (wavelength * (high - low)) - low / (high - low)
        (w1, s1), (w2, s2) = smooth[0], smooth[-1]
        slope = (s1 - s2) / (1 / w1 - 1 / w2)
        span = original / slope
        low = -(s1 - slope / w1) * span
        return factor, low, low + span, original
    if smooth:
        raise BadGGUF(f"{ROPE_FREQS}: one smoothed frequency does not say where the smoothing starts and ends")
    # No smoothed frequency: any bounds between the kept and the slowed-down wavelengths do.
    kept = max([w for w, d in zip(wavelengths, divisors) if d == 1], default=wavelengths[0] / 2)
    slowed = min(w for w, d in zip(wavelengths, divisors) if d == factor)
    return factor, original / slowed * 1.001, original / kept * 0.999, original
