"""The parameters a model has, by name, with their shapes and dtypes, from its Architecture alone
and without torch: what the pool keeper sizes a pool by (parameter_bytes).

The table lists what the model files build (llama.py, gpt2.py, int8.use_int8), parameter for
parameter; tests/test_parameter_table.py holds it equal to a built skeleton's for each kind.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from mcpd import gguf_file
from mcpd.config import ModelConfig
from mcpd.models import architecture
from mcpd.models.architecture import Architecture, GemmaArgs, GPT2Args, LlamaArgs
from mcpd.quant import int4_layout
from mcpd.quant.int8_layout import GGUF_GROUP, GROUP, SCALE_SUFFIX, groups

ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}
Shape = tuple[int, ...]


def parameter_bytes(config: ModelConfig, device: str) -> int:
    """The bytes the model's parameters take on the device (a torch device's string: "cpu",
    "cuda:0"); UnsupportedModel as the loader refuses it."""
    table = parameters(architecture.of(config, device.partition(":")[0]))
    return sum(math.prod(shape) * ITEM_BYTES[dtype] for shape, dtype in table.values())


def parameters(arch: Architecture) -> dict[str, tuple[Shape, str]]:
    """name -> (shape, dtype) of each parameter, as named_parameters() of the loader's skeleton."""
    listed = (_llama(arch.args) if isinstance(arch.args, LlamaArgs)
              else _gemma(arch.args) if isinstance(arch.args, GemmaArgs) else _gpt2(arch.args))
    table = {}
    kept = arch.hf.get(gguf_file.KEPT_QUANTIZED, {})   # a GGUF's quantized matrices (int8.hold_int8, int4.hold_int4)
    for name, shape, linear in listed:
        form = kept.get(name)
        if isinstance(form, tuple):   # split_linear.py: parts of different forms
            for index, (part_form, rows) in enumerate(form):
                table.update(_kept(gguf_file.part_name(name, index), part_form, (rows, shape[1])))
        elif form is not None:
            table.update(_kept(name, form, shape))
        elif linear and arch.quantization == "int8":   # int8.use_int8: every nn.Linear's weight
            table[name] = shape, "int8"
            table[name + SCALE_SUFFIX] = (shape[0], groups(shape[1], GROUP)), "float32"
        else:
            table[name] = shape, arch.dtype
    return table


def _kept(name: str, form: str, shape: Shape) -> dict[str, tuple[Shape, str]]:
    """The parameters of a matrix a GGUF keeps in form: int8 in its groups, or 4-bit."""
    if form in int4_layout.FORMS:
        return {name + suffix: piece for suffix, piece in int4_layout.pieces(form, *shape).items()}
    return {name: (shape, "int8"), name + SCALE_SUFFIX: ((shape[0], groups(shape[1], GGUF_GROUP)), "float32")}


Listed = Iterator[tuple[str, Shape, bool]]   # name, shape, whether it is an nn.Linear's weight


def _linear(name: str, inputs: int, outputs: int, bias: bool) -> Listed:
    yield f"{name}.weight", (outputs, inputs), True
    if bias:
        yield f"{name}.bias", (outputs,), False


def _decoder(a: LlamaArgs | GemmaArgs, layer: Callable[[str], Listed]) -> Listed:
    """Embedding, each layer's parameters (layer(its name prefix)), final norm and an untied head."""
    yield "model.embed_tokens.weight", (a.vocab_size, a.hidden_size), False
    for i in range(a.num_layers):
        yield from layer(f"model.layers.{i}.")
    yield "model.norm.weight", (a.hidden_size,), False
    if not a.tie_embeddings:   # tied: the embedding is the head
        yield from _linear("lm_head", a.hidden_size, a.vocab_size, False)


def _qk_norms(a: LlamaArgs | GemmaArgs, layer: str) -> Listed:
    if a.qk_norm:
        yield layer + "self_attn.q_norm.weight", (a.head_dim,), False
        yield layer + "self_attn.k_norm.weight", (a.head_dim,), False


def _llama(a: LlamaArgs) -> Listed:
    hidden, q_size, kv_size = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim

    def layer(prefix: str) -> Listed:
        yield prefix + "input_layernorm.weight", (hidden,), False
        yield from _linear(prefix + "self_attn.qkv_proj", hidden, q_size + 2 * kv_size, a.qkv_bias)
        yield from _linear(prefix + "self_attn.o_proj", q_size, hidden, a.o_bias)
        yield from _qk_norms(a, prefix)
        yield prefix + "post_attention_layernorm.weight", (hidden,), False
        if a.num_experts:
            yield from _experts(a, prefix + "block_sparse_moe.")
        else:
            yield from _linear(prefix + "mlp.gate_up_proj", hidden, 2 * a.intermediate_size, a.mlp_bias)
            yield from _linear(prefix + "mlp.down_proj", a.intermediate_size, hidden, a.mlp_bias)
    return _decoder(a, layer)


def _experts(a: LlamaArgs, prefix: str) -> Listed:
    yield from _linear(prefix + "gate", a.hidden_size, a.num_experts, False)
    for e in range(a.num_experts):
        yield from _linear(f"{prefix}experts.{e}.gate_up_proj", a.hidden_size, 2 * a.intermediate_size, False)
        yield from _linear(f"{prefix}experts.{e}.down_proj", a.intermediate_size, a.hidden_size, False)


def _gemma(a: GemmaArgs) -> Listed:
    hidden, q_size, kv_size = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim

    def layer(prefix: str) -> Listed:
        yield prefix + "input_layernorm.weight", (hidden,), False
        for name, outputs in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
            yield from _linear(prefix + "self_attn." + name, hidden, outputs, False)
        yield from _linear(prefix + "self_attn.o_proj", q_size, hidden, False)
        yield from _qk_norms(a, prefix)
        for norm in ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            yield prefix + norm + ".weight", (hidden,), False
        for name, inputs, outputs in (("gate_proj", hidden, a.intermediate_size),
                                      ("up_proj", hidden, a.intermediate_size),
                                      ("down_proj", a.intermediate_size, hidden)):
            yield from _linear(prefix + "mlp." + name, inputs, outputs, False)
    return _decoder(a, layer)


def _gpt2(a: GPT2Args) -> Listed:
    hidden = a.hidden_size
    yield "wte.weight", (a.vocab_size, hidden), False
    yield "wpe.weight", (a.max_positions, hidden), False
    for i in range(a.num_layers):
        block = f"h.{i}."
        yield from _layer_norm(block + "ln_1", hidden)
        yield from _linear(block + "attn.c_attn", hidden, 3 * hidden, True)
        yield from _linear(block + "attn.c_proj", hidden, hidden, True)
        yield from _layer_norm(block + "ln_2", hidden)
        yield from _linear(block + "mlp.c_fc", hidden, a.inner_size, True)
        yield from _linear(block + "mlp.c_proj", a.inner_size, hidden, True)
    yield from _layer_norm("ln_f", hidden)
    if not a.tie_embeddings:
        yield from _linear("lm_head", hidden, a.vocab_size, False)


def _layer_norm(name: str, size: int) -> Listed:
    yield f"{name}.weight", (size,), False
    yield f"{name}.bias", (size,), False
