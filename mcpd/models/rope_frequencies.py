"""Rotary inverse frequencies of each rope scaling type (rope_scaling.py), in transformers'
formulas and float32 order of operations (modeling_rope_utils), so the angles round alike."""
from __future__ import annotations

import math

import torch

from mcpd.models.rope_scaling import (DynamicRope, LinearRope, Llama3RopeScaling, LongRope, RopeScaling,
                                      YarnRope)


def plain(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None,
                        device: torch.device) -> torch.Tensor:
    """[head_dim / 2] float32; for a type whose frequencies depend on the length, those of a
    sequence within the trained length (by_length gives the others)."""
    inv_freq = plain(head_dim, theta, device)
    if isinstance(scaling, Llama3RopeScaling):
        return llama3_scaled(inv_freq, scaling)
    if isinstance(scaling, LinearRope):
        return inv_freq / scaling.factor
    if isinstance(scaling, YarnRope):
        return _yarn(head_dim, theta, scaling, device)
    if isinstance(scaling, LongRope):
        return _longrope(head_dim, theta, scaling.short_factor, device)
    return inv_freq


def by_length(head_dim: int, theta: float, scaling: DynamicRope | LongRope, lengths: torch.Tensor,
              within: torch.Tensor) -> torch.Tensor:
    """[T, head_dim / 2]: the frequencies of each row of a step, whose sequence is lengths[row]
    tokens long at that step; within: those of a sequence within the trained length."""
    device = lengths.device
    if isinstance(scaling, LongRope):
        longer = lengths > scaling.original_max_position_embeddings
        return torch.where(longer[:, None], _longrope(head_dim, theta, scaling.long_factor, device), within)
    longer = lengths > scaling.max_positions
    # transformers grows the base with a tensor length, so in float32
    base = theta * ((scaling.factor * lengths / scaling.max_positions) - (scaling.factor - 1)) ** (
        head_dim / (head_dim - 2))
    grown = 1.0 / (base[:, None] ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
                                     / head_dim))
    return torch.where(longer[:, None], grown, within)


def attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by (yarn and longrope scale the attention logits so)."""
    return getattr(scaling, "attention_factor", 1.0)


def llama3_scaled(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """inv_freq with rope scaling of type "llama3" (Llama 3.1+): long wavelengths are slowed down
    by scaling.factor, short ones kept, the ones between smoothed."""
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= old_len / scaling.high_freq_factor) & (wavelen <= old_len / scaling.low_freq_factor)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, scaling: YarnRope, device: torch.device) -> torch.Tensor:
    """Extrapolated (plain) frequencies above the ramp, interpolated (divided by factor) below it."""
    low, high = _correction_range(scaling, dim, base)
    if low == high:
        high += 0.001   # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolation = 1 - ramp
    return 1.0 / (scaling.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def _correction_range(scaling: YarnRope, dim: int, base: float) -> tuple[float, float]:
    def dimension(rotations: float) -> float:   # the dimension that turns `rotations` times over the length
        return dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(base))
    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _longrope(dim: int, base: float, factors: tuple[float, ...], device: torch.device) -> torch.Tensor:
    ext_factors = torch.tensor(factors, dtype=torch.float32, device=device)
    return 1.0 / (ext_factors * base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
