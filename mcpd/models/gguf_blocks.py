"""GGUF's quantized blocks as the forms that keep them (quant/int8.py, quant/int4.py), in numpy:
a Q8_0 tensor as int8 values and float32 scales in groups of 32, a Q4_0 or Q4_1 one as its bytes
and float16 scales (and Q4_1's mins). Rows first, as the engine's parameters; nothing is dequantized.

Bytes of a block (ggml-common.h): Q8_0 d (float16) then 32 int8; Q4_0 d then 16 bytes of
nibbles; Q4_1 d, m, then the nibbles.
"""
from __future__ import annotations

import numpy as np

from mcpd.quant.int4_layout import MINS_SUFFIX, SCALES_SUFFIX
from mcpd.quant.int8_layout import SCALE_SUFFIX

_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def pieces(data: np.ndarray, type_name: str, rows: int) -> dict[str, np.ndarray]:
    """The parameter suffix ("" for the weight itself) -> array of a quantized tensor's raw
    bytes (data: [rows, bytes a row], the reader's view of the file)."""
    blocks = np.asarray(data).reshape(rows, -1, _BLOCK_BYTES[type_name])
    d = _float16(blocks[:, :, 0:2])
    if type_name == "Q8_0":
        return dict(zip(("", SCALE_SUFFIX), _int8_with_positive_scales(blocks[:, :, 2:].view(np.int8), d)))
    if type_name == "Q4_0":
        return {"": blocks[:, :, 2:].reshape(rows, -1), SCALES_SUFFIX: d}
    return {"": blocks[:, :, 4:].reshape(rows, -1), SCALES_SUFFIX: d, MINS_SUFFIX: _float16(blocks[:, :, 2:4])}


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
