"""Small Q4_K and Q6_K quantizers for tests (the gguf package dequantizes them but cannot
quantize them): per block a scale (Q4_K: and a min) from its range, each super-block's d (and
dmin) from the largest, all rounded as the format stores them. Not llama.cpp's search for the best scales; the
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


def quantize_q6_k(weights: np.ndarray) -> np.ndarray:
    """float32 [rows, k] (k a multiple of 256) -> the Q6_K bytes [rows, k / 256 * 210]:
    w = d * scale * (q - 32), a scale of 16 columns."""
    rows = weights.shape[0]
    x = weights.astype(np.float32).reshape(rows, -1, SUPER // 16, 16)
    scale = np.abs(x).max(axis=-1) / 31
    d = (scale.max(axis=-1) / 127).astype(np.float16)
    unit = d.astype(np.float32)[..., None]
    sc = np.rint(np.where(unit > 0, scale / np.where(unit > 0, unit, 1), 0)).clip(-128, 127).astype(np.int8)
    step = (unit * sc)[..., None]
    q = (np.where(step > 0, np.rint(x / np.where(step > 0, step, 1)), 0).clip(-32, 31) + 32).astype(np.uint8)
    q = q.reshape(rows, -1, 2, 128)                                  # halves of 128 columns
    ql = (q[..., :64] & 15) | ((q[..., 64:] & 15) << 4)              # [.., 2, 64]
    top = (q >> 4).reshape(rows, -1, 2, 4, 32)                       # [.., half, s, i]: column 32s + i
    qh = top[:, :, :, 0] | (top[:, :, :, 1] << 2) | (top[:, :, :, 2] << 4) | (top[:, :, :, 3] << 6)
    blocks = np.concatenate((ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), sc.view(np.uint8),
                             d[..., None].view(np.uint8)), axis=-1)
    return blocks.reshape(rows, -1)


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}
