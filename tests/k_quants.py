"""A small Q4_K quantizer for tests (the gguf package dequantizes Q4_K but cannot quantize it):
per block of 32 a scale and a min from its range, each super-block's d and dmin from the
largest, all rounded as the format stores them. Not llama.cpp's search for the best scales; the
tests compare the kept weights with the gguf package's dequantize of these very bytes."""
from __future__ import annotations

import numpy as np

SUPER, BLOCK = 256, 32


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """float32 [rows, k] (k a multiple of 256) -> the Q4_K bytes [rows, k / 256 * 144]."""
    rows = weights.shape[0]
    x = weights.astype(np.float32).reshape(rows, -1, SUPER // BLOCK, BLOCK)
    low = np.minimum(x.min(axis=-1), 0)                       # w = d * sc * q - dmin * m, m >= 0
    scale = (x.max(axis=-1) - low) / 15
    d = (scale.max(axis=-1) / 63).astype(np.float16)
    dmin = (-low.min(axis=-1) / 63).astype(np.float16)
    sc = _six_bits(scale, d)
    m = _six_bits(-low, dmin)
    step = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * m
    q = np.where(step[..., None] > 0, np.rint((x + offset[..., None]) / np.where(step > 0, step, 1)[..., None]), 0)
    q = q.clip(0, 15).astype(np.uint8).reshape(rows, -1, 4, 2, BLOCK)   # chunks of 64: low then high nibbles
    packed = q[:, :, :, 0] | (q[:, :, :, 1] << 4)
    head = np.concatenate((d[..., None], dmin[..., None]), axis=-1).view(np.uint8)
    blocks = np.concatenate((head, _packed_scales(sc, m), packed.reshape(rows, -1, 128)), axis=-1)
    return blocks.reshape(rows, -1)


def _six_bits(values: np.ndarray, unit: np.ndarray) -> np.ndarray:
    unit = unit.astype(np.float32)[..., None]
    return np.rint(np.where(unit > 0, values / np.where(unit > 0, unit, 1), 0)).clip(0, 63).astype(np.uint8)


def _packed_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins [..., 8] each -> ggml's 12 bytes [..., 12]."""
    first = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    second = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    third = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return np.concatenate((first, second, third), axis=-1)
