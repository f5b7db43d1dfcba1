"""Rope scaling as config.json describes it (rope_parameters, or rope_scaling in older configs), read
without torch: each type's parameters and the context length it gives. The frequencies themselves
are rope_frequencies.py's, in transformers' formulas (modeling_rope_utils)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from mcpd.models import config_fields
from mcpd.models.config_fields import shown

TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# Bounds that keep the rope table finite in every dtype: a factor that divides frequencies (a
# frequency of 1, times 2^24 positions, stays far within float32), and one that scales cos and
# sin (yarn's and longrope's own stay under 3; float16 ends at 65504). Checkpoints' are near 1.
LEAST_DIVISOR = 1e-3
MOST_ATTENTION_FACTOR = 100.0


def _times(length: int, factor) -> int | float:
    """length * factor as a context length; length itself for a factor that is no finite positive
    number, and an infinite product as it is: model_sizes.check then refuses either by name."""
    if type(factor) not in (int, float) or not 0 < factor < math.inf:
        return length
    product = length * factor
    return int(product) if product < math.inf else product


class UnsupportedRope(ValueError):
    """A rope type or parameter mcpd cannot run; architecture.py names the model with it."""


def _divisors(**factors) -> None:
    """UnsupportedRope naming the first factor (or list of them) that divides frequencies by
    less than LEAST_DIVISOR."""
    for name, values in factors.items():
        for value in values if isinstance(values, tuple) else (values,):
            if value < LEAST_DIVISOR:
                raise UnsupportedRope(f"rope {name} {shown(value)} is less than {LEAST_DIVISOR} (it divides rope "
                                      "frequencies)")


def _attention_factor(value: float) -> None:
    if value > MOST_ATTENTION_FACTOR:
        raise UnsupportedRope(f"rope attention_factor {shown(value)} is more than {MOST_ATTENTION_FACTOR:g} (cos and "
                              "sin are scaled by it)")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """rope_scaling of type "llama3" (Llama 3.1+): long wavelengths are slowed down by `factor`
    (rope_frequencies.llama3_scaled)."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    by_length: ClassVar[bool] = False   # whether the frequencies depend on the sequence's length
    scales_context: ClassVar[bool] = False   # whether factor scales the context length

    def context_length(self, max_positions: int) -> int:
        return max_positions

    def checked(self) -> tuple[list, list]:
        """(counts, reals): the values model_sizes.check holds to their bounds."""
        return ([("rope original_max_position_embeddings", self.original_max_position_embeddings)],
                [(f"rope {name}", getattr(self, name)) for name in ("factor", "low_freq_factor", "high_freq_factor")])

    def check_table(self, head_dim: int) -> None:
        """UnsupportedRope naming a value (each finite and positive: checked) that would make the
        rope table divide by zero or overflow."""
        _divisors(factor=self.factor)
        if self.high_freq_factor <= self.low_freq_factor:   # the smoothing divides by their difference
            raise UnsupportedRope(f"rope high_freq_factor {shown(self.high_freq_factor)} is not more than rope "
                                  f"low_freq_factor {shown(self.low_freq_factor)}")


@dataclass(frozen=True)
class LinearRope:
    """Positions divided by factor: the context is factor times the trained one."""
    factor: float
    by_length: ClassVar[bool] = False
    scales_context: ClassVar[bool] = True

    def context_length(self, max_positions: int) -> int:
        return _times(max_positions, self.factor)

    def checked(self) -> tuple[list, list]:
        return [], [("rope factor", self.factor)]

    def check_table(self, head_dim: int) -> None:
        _divisors(factor=self.factor)


@dataclass(frozen=True)
class DynamicRope:
    """NTK scaling: past max_positions the base grows with the sequence's length, so the
    frequencies of a step depend on how long its sequence is then."""
    factor: float
    max_positions: int
    by_length: ClassVar[bool] = True
    scales_context: ClassVar[bool] = True

    def context_length(self, max_positions: int) -> int:
        return _times(max_positions, self.factor)

    def checked(self) -> tuple[list, list]:
        return [], [("rope factor", self.factor)]

    def check_table(self, head_dim: int) -> None:
        _divisors(factor=self.factor)
        if head_dim == 2:
            raise UnsupportedRope("rope type 'dynamic' with head_dim 2 (its base grows by the power "
                                  "head_dim / (head_dim - 2))")


@dataclass(frozen=True)
class YarnRope:
    """YaRN: high frequencies kept, low ones interpolated by factor, a ramp between (beta_fast,
    beta_slow rotations), and cos and sin scaled by attention_factor."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    attention_factor: float
    truncate: bool
    by_length: ClassVar[bool] = False
    scales_context: ClassVar[bool] = True

    def context_length(self, max_positions: int) -> int:
        return _times(self.original_max_position_embeddings, self.factor)

    def check_table(self, head_dim: int) -> None:
        _divisors(factor=self.factor)
        _attention_factor(self.attention_factor)

    def checked(self) -> tuple[list, list]:
        return ([("rope original_max_position_embeddings", self.original_max_position_embeddings)],
                [(f"rope {name}", getattr(self, name)) for name in ("factor", "beta_fast", "beta_slow",
                                                                     "attention_factor")])


@dataclass(frozen=True)
class LongRope:
    """LongRoPE (Phi-3): a factor per frequency, short_factor while the sequence is within
    original_max_position_embeddings, long_factor past it (by length), cos and sin scaled by
    attention_factor."""
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float
    by_length: ClassVar[bool] = True
    scales_context: ClassVar[bool] = False

    def context_length(self, max_positions: int) -> int:
        return max_positions

    def check_table(self, head_dim: int) -> None:
        _divisors(short_factor=self.short_factor, long_factor=self.long_factor)
        _attention_factor(self.attention_factor)

    def checked(self) -> tuple[list, list]:
        return ([("rope original_max_position_embeddings", self.original_max_position_embeddings)],
                [("rope attention_factor", self.attention_factor)]
                + [("rope short_factor", f) for f in self.short_factor]
                + [("rope long_factor", f) for f in self.long_factor])


RopeScaling = Llama3RopeScaling | LinearRope | DynamicRope | YarnRope | LongRope


def read(rope: dict, hf: dict, head_dim: int) -> RopeScaling | None:
    """The scaling config.json's rope dict describes (None: plain rope); hf is all of config.json.
    UnsupportedRope for another type; config_fields.BadField for a value of the wrong type."""
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedRope("partial_rotary_factor (rotary on part of each head)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    max_positions = config_fields.count(hf, "max_position_embeddings", 2048)
    # Phi-3 keeps the pretrained length outside the rope dict, and transformers prefers it there.
    original = (config_fields.count(hf, "original_max_position_embeddings", None)
                or config_fields.count(rope, "original_max_position_embeddings", max_positions,
                                       name="rope original_max_position_embeddings"))
    if rope_type == "default":
        return None
    if rope_type == "llama3":
        return Llama3RopeScaling(rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"], original)
    if rope_type == "linear":
        return LinearRope(rope["factor"])
    if rope_type == "dynamic":
        return DynamicRope(rope["factor"], max_positions)
    if rope_type == "yarn":
        return _yarn(rope, original, max_positions)
    if rope_type == "longrope":
        return _longrope(rope, original, max_positions, head_dim)
    raise UnsupportedRope(f"rope type {rope_type!r:.100} (supported: {', '.join(TYPES)})")


def _real(rope: dict, key: str, zero: bool = False):
    return config_fields.real(rope, key, None, f"rope {key}", zero)


def _yarn(rope: dict, original: int, max_positions: int) -> YarnRope:
    factor = _real(rope, "factor") or max_positions / original
    attention_factor = _real(rope, "attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = _real(rope, "mscale", zero=True), _real(rope, "mscale_all_dim", zero=True)   # 0: unset
        attention_factor = (_mscale(factor, mscale) / _mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                            else _mscale(factor, 1))
    return YarnRope(factor, original, rope.get("beta_fast") or 32, rope.get("beta_slow") or 1,
                    float(attention_factor), config_fields.flag(rope, "truncate", True, "rope truncate"))


def _mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope(rope: dict, original: int, max_positions: int, head_dim: int) -> LongRope:
    short = config_fields.reals(rope, "short_factor", "rope short_factor")
    long = config_fields.reals(rope, "long_factor", "rope long_factor")
    if len(short) != head_dim // 2 or len(long) != head_dim // 2:
        raise UnsupportedRope(f"longrope factors: {len(short)} short and {len(long)} long for "
                              f"{head_dim // 2} frequencies")
    factor = _real(rope, "factor") or max_positions / original
    attention_factor = _real(rope, "attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRope(short, long, original, float(attention_factor))


def phi3(rope: dict) -> dict:
    """Phi-3's rope dict as transformers' Phi3Config reads it: types "su" and "yarn" are longrope."""
    if rope.get("rope_type", rope.get("type")) in ("su", "yarn"):
        return {**rope, "rope_type": "longrope"}
    return rope


def gemma_ropes(hf: dict, gemma3: bool) -> tuple[dict, dict]:
    """The rope dicts of Gemma's global and local layers: Gemma 3 nests one per layer type
    (transformers 5; older configs: rope_scaling for the global layers, rope_local_base_freq),
    Gemma 2 has one for both."""
    rope = config_fields.mapping(hf, "rope_parameters")
    if gemma3 and "full_attention" in rope:
        return (config_fields.mapping(rope, "full_attention", "rope_parameters.full_attention"),
                config_fields.mapping(rope, "sliding_attention", "rope_parameters.sliding_attention"))
    scaling = config_fields.mapping(hf, "rope_scaling")
    if gemma3:
        global_rope = {**scaling, "rope_theta": hf.get("rope_theta", 1_000_000.0)}
        return global_rope, {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    rope = rope or {**scaling, "rope_theta": hf.get("rope_theta", 10_000.0)}
    return rope, rope
