"""GGUF's quantized blocks as the forms that keep them (quant/int8.py, quant/int4.py), in numpy:
a Q8_0 or Q5_0 tensor as int8 values and float32 scales in groups of 32, a Q4_0 or Q4_1 one as its bytes
and float16 scales (and Q4_1's mins), a Q4_K one as Q4_1-ordered bytes, its 6-bit scales and mins
a byte each and its super-blocks' float16 d and dmin, a Q6_K one as Q4_1-ordered low nibbles,
their top two bits, int8 scales of 16 and the super-blocks' d. Rows first, as the engine's
parameters; nothing is dequantized.

Bytes of a block (ggml-common.h): Q8_0 d (float16) then 32 int8; Q4_0 d then 16 bytes of
nibbles; Q4_1 d, m, then the nibbles; Q5_0 d, 4 bytes of fifth bits, then the nibbles: w = d * (q - 16),
q in [0, 31], so an int8 group of 32 holds it exactly. A Q4_K super-block of 256: d, dmin, 12 bytes packing eight
6-bit scales and eight 6-bit mins, then 128 bytes whose low nibbles are columns 64c..64c+31 and
high nibbles 64c+32..64c+63 for each 32 bytes c. A Q6_K super-block of 256: 128 bytes of low
nibbles (each half of 128 columns: 64 bytes, low nibbles its first 64, high its last 64), 64
bytes of top bits (each half: 32 bytes, bits 2s..2s+1 of byte i column 32s + i), 16 int8 scales,
then d; w = d * scale * (q - 32).
"""
from __future__ import annotations

import numpy as np

from mcpd.quant.int4_layout import HIGHS_SUFFIX, MINS_SUFFIX, SCALES_SUFFIX, SUPERS_SUFFIX
from mcpd.quant.int8_layout import SCALE_SUFFIX

_BLOCK_BYTES = {"Q8_0": 34, "Q5_0": 22, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q6_K": 210}


def pieces(data: np.ndarray, type_name: str, rows: int) -> dict[str, np.ndarray]:
    """The parameter suffix ("" for the weight itself) -> array of a quantized tensor's raw
    bytes (data: [rows, bytes a row], the reader's view of the file)."""
    blocks = np.asarray(data).reshape(rows, -1, _BLOCK_BYTES[type_name])
    if type_name == "Q4_K":
        return _q4_k(blocks)
    if type_name == "Q6_K":
        return _q6_k(blocks)
    d = _float16(blocks[:, :, 0:2])
    if type_name == "Q8_0":
        return dict(zip(("", SCALE_SUFFIX), _int8_with_positive_scales(blocks[:, :, 2:].view(np.int8), d)))
    if type_name == "Q5_0":
        return dict(zip(("", SCALE_SUFFIX), _int8_with_positive_scales(_five_bit(blocks[:, :, 2:]), d)))
    if type_name == "Q4_0":
        return {"": blocks[:, :, 2:].reshape(rows, -1), SCALES_SUFFIX: d}
    return {"": blocks[:, :, 4:].reshape(rows, -1), SCALES_SUFFIX: d, MINS_SUFFIX: _float16(blocks[:, :, 2:4])}


def _q4_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Q4_K super-blocks [rows, supers, 144] as the 4-bit form's pieces."""
    rows, supers = blocks.shape[:2]
    scales, mins = _six_bit_scales_and_mins(blocks[:, :, 4:16])
    qs = blocks[:, :, 16:].reshape(rows, supers, 4, 1, 32)
    q = np.concatenate((qs & 15, qs >> 4), axis=3).reshape(rows, -1, 32)   # each block's 32 in column order
    return {"": _q4_1_order(q), SCALES_SUFFIX: scales.reshape(rows, -1), MINS_SUFFIX: mins.reshape(rows, -1),
            SUPERS_SUFFIX: np.ascontiguousarray(blocks[:, :, :4]).view(np.float16)}


def _q6_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Q6_K super-blocks [rows, supers, 210] as the 4-bit form's pieces, the top two bits of
    block b's column c in byte 8b + c % 8 at bits 2 * (c // 8)."""
    rows, supers = blocks.shape[:2]
    ql = blocks[:, :, :128].reshape(rows, supers, 2, 1, 64)
    qh = blocks[:, :, 128:192].reshape(rows, supers, 2, 1, 32)
    low = np.concatenate((ql & 15, ql >> 4), axis=3).reshape(rows, supers, 2, 128)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3          # [.., 2, 4, 32]
    high = high.reshape(rows, -1, 4, 8)                                        # each block's 32: [c // 8][c % 8]
    highs = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return {"": _q4_1_order(low.reshape(rows, -1, 32)), HIGHS_SUFFIX: highs.reshape(rows, -1),
            SCALES_SUFFIX: np.ascontiguousarray(blocks[:, :, 192:208]).view(np.int8).reshape(rows, -1),
            SUPERS_SUFFIX: np.ascontiguousarray(blocks[:, :, 208:210]).view(np.float16)}


def _five_bit(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 blocks after d [rows, blocks, 20] -> their weights q - 16 as int8 [rows, blocks, 32]:
    column c's low 4 bits in byte 4 + c % 16 (low nibble for c < 16), its fifth bit bit c of
    the little-endian 32 bits in bytes 0-3."""
    high = (np.ascontiguousarray(blocks[:, :, :4]).view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
    qs = blocks[:, :, 4:]
    low = np.concatenate((qs & 15, qs >> 4), axis=2)
    return ((low | (high.astype(np.uint8) << 4)).astype(np.int8) - 16).astype(np.int8)


def _q4_1_order(q: np.ndarray) -> np.ndarray:
    """4-bit values [rows, blocks, 32] in column order -> Q4_1's bytes [rows, blocks * 16]."""
    return (q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(q.shape[0], -1)


def _six_bit_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] bytes -> ([..., 8], [..., 8]): blocks 0-3 have their scale and min in the low 6
    bits of bytes 0-3 and 4-7; blocks 4-7 their low 4 bits in bytes 8-11 (scale low nibble, min
    high) and their top 2 bits in the top 2 bits of bytes 0-3 (scale) and 4-7 (min)."""
    low, high, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate((low & 63, (rest & 15) | ((low >> 6) << 4)), axis=-1)
    mins = np.concatenate((high & 63, (rest >> 4) | ((high >> 6) << 4)), axis=-1)
    return scales, mins


def _float16(two_bytes: np.ndarray) -> np.ndarray:
    """[rows, blocks, 2] bytes -> [rows, blocks] float16."""
    return np.ascontiguousarray(two_bytes).view(np.float16)[:, :, 0]


def _int8_with_positive_scales(values: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 values [rows, columns], float32 scales [rows, blocks]) of Q8_0 blocks, every scale
    made positive as the int8 form's are (int8.bad_scales): a block of scale 0 is all zeros
    (scale 1), one of a negative scale is negated (a file llama.cpp's quantizer did not write)."""
    scales = d.astype(np.float32)
    sign, wide = scales[:, :, None], values.astype(np.int16)
    wide = np.where(sign < 0, -wide.clip(-127), np.where(sign > 0, wide, 0))
    return wide.astype(np.int8).reshape(values.shape[0], -1), np.where(scales == 0, np.float32(1), np.abs(scales))
