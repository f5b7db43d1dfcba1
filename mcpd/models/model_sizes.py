"""The bounds of a model's sizes and reals, held to them by check before anything is built from
them, each refusal naming the field as the model's file spells it (config.json's, or a GGUF's
metadata key) with its value cut to a readable length. Free of torch, as architecture.py.
"""
from __future__ import annotations

from mcpd.models.config_fields import BadField, finite, shown

# The largest value each count may have. A config.json is a file an operator was handed: a
# layer count of 10^9 or a vocabulary of 2^62 must be refused with its name, not make the pool
# keeper list a billion parameters or the loader build them. The caps are far above any model
# mcpd could hold in memory (Llama 3.1 405B: 126 layers, hidden 16384, vocab 128256).
SIZE_CAPS = {"vocab_size": 1 << 22, "hidden_size": 1 << 17, "intermediate_size": 1 << 19, "num_layers": 1 << 12,
             "num_heads": 1 << 12, "num_kv_heads": 1 << 12, "head_dim": 1 << 12, "inner_size": 1 << 19,
             "max_positions": 1 << 24}
MAX_EXPERTS = 1 << 10
MAX_MODEL_LEN = 1 << 24
THETAS = ("rope_theta", "global_rope_theta", "local_rope_theta")   # as REALS, and above 1
REALS = ("rms_norm_eps", "layer_norm_eps", "query_pre_attn_scalar", *THETAS)   # must be finite and positive
OPTIONAL_REALS = ("attn_softcap", "final_softcap")   # None, or as REALS
SCALINGS = ("rope_scaling", "global_rope_scaling", "local_rope_scaling")

# The model's own names of the fields mcpd renames (architecture's *Args), by family.
DECODER_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                 "num_kv_heads": "num_key_value_heads", "model_len": "max_position_embeddings"}
GEMMA_NAMES = {**DECODER_NAMES, "attn_softcap": "attn_logit_softcapping", "final_softcap": "final_logit_softcapping",
               "global_rope_theta": "rope_theta of the global layers",
               "local_rope_theta": "rope_theta of the local layers"}
GPT2_NAMES = {"hidden_size": "n_embd", "num_layers": "n_layer", "num_heads": "n_head", "inner_size": "n_inner",
              "max_positions": "n_positions", "model_len": "n_positions", "layer_norm_eps": "layer_norm_epsilon"}


def check(args, model_len, names: dict[str, str]) -> None:
    """BadField (UnsupportedRope for a scaling's table; architecture.py adds the file) naming the
    first count of args that is not a whole number within its cap, real that is not finite and
    positive, rope theta not above 1, rope scaling whose values would make the rope table divide
    by zero or overflow (rope_scaling.py), or query heads not shared evenly by KV heads. names:
    the model's own name of each field it renames (as DECODER_NAMES)."""
    scalings = [scaling for scaling in (getattr(args, name, None) for name in SCALINGS) if scaling is not None]
    for name, value, cap in _counts(args, scalings, names):
        _whole(name, value, cap)
    for name, value in _reals(args, scalings):
        if not finite(value) or value <= 0:
            raise BadField(f"{names.get(name, name)} {shown(value)} is not a finite positive number")
    for name in THETAS:
        if getattr(args, name, 2) <= 1:   # yarn divides by its logarithm; below 1 frequencies outgrow float32
            raise BadField(f"{names.get(name, name)} {shown(getattr(args, name))} is not more than 1 (rope's "
                           "frequencies are its inverse powers)")
    _check_context(model_len, scalings[0] if scalings else None, names)
    for scaling in scalings:
        scaling.check_table(args.head_dim)
    if hasattr(args, "num_kv_heads") and args.num_heads % args.num_kv_heads:
        raise BadField(f"{args.num_heads} query heads cannot share {args.num_kv_heads} KV heads evenly")


def _counts(args, scalings: list, names: dict[str, str]) -> list[tuple[str, object, int]]:
    """(name, value, cap) of each count of args and its rope scalings."""
    counts = [(names.get(name, name), getattr(args, name), cap)
              for name, cap in SIZE_CAPS.items() if hasattr(args, name)]
    if getattr(args, "sliding_window", None) is not None:
        counts.append(("sliding_window", args.sliding_window, MAX_MODEL_LEN))
    return counts + [(name, value, MAX_MODEL_LEN) for scaling in scalings for name, value in scaling.checked()[0]]


def _reals(args, scalings: list) -> list[tuple[str, object]]:
    """(name, value) of each real of args and its rope scalings."""
    reals = [(name, getattr(args, name)) for name in REALS if hasattr(args, name)]
    reals += [(name, getattr(args, name)) for name in OPTIONAL_REALS if getattr(args, name, None) is not None]
    return reals + [real for scaling in scalings for real in scaling.checked()[1]]


def _check_context(model_len, scaling, names: dict[str, str]) -> None:
    """The context length, named by the field it is read from, or the rope factor that scales it."""
    if scaling is not None and scaling.scales_context and not _in_range(model_len, MAX_MODEL_LEN):
        raise BadField(f"rope factor {shown(scaling.factor)} makes the context {shown(model_len)} tokens, not a "
                       f"whole number from 1 to {MAX_MODEL_LEN}")
    _whole(names.get("model_len", "context length"), model_len, MAX_MODEL_LEN)


def _whole(name: str, value, cap: int) -> None:
    if not _in_range(value, cap):
        raise BadField(f"{name} {shown(value)} is not a whole number from 1 to {cap}")


def _in_range(value, cap: int) -> bool:
    return type(value) is int and 1 <= value <= cap
