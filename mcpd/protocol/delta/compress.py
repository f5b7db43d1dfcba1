"""When a payload is worth packing with zstd, and packing it: whole, or an XOR made and packed window
by window so that no payload-sized intermediate exists."""
from __future__ import annotations

from typing import Callable

import numpy as np

from mcpd.protocol import safe_zstd
from mcpd.protocol.change_entry import PayloadMeta
from mcpd.protocol.delta.field import FieldDelta, words


# Level 1 rather than 3: on the XOR of a sparsely changed float array it packs at least as tightly,
# in less time. An XOR streamed to the compressor in windows gains from worker threads (they pack
# while this thread XORs the next window), where a one-shot compress on few cores would not; the
# worker count does not change the frame (zstd promises as much).
COMPRESSION_LEVEL = 1
XOR_COMPRESSION_THREADS = 2
# XOR deltas are mostly zero runs, which zstd's fast (negative) levels find as well as level 1,
# and sooner; below -1 the frames grow.
XOR_COMPRESSION_LEVEL = -1
# Large XORs are made, packed and (on apply) unpacked window by window: no payload-sized
# intermediate, and each window is still in cache when the next step reads it.
XOR_WINDOW_BYTES = 1 << 20
# zstd only pays when it saves real bytes: packing and unpacking a MB take a good share of the
# 8 ms a 1 Gb/s link carries it in, so saving less than a fifth (ratio < 1.25) does not repay the
# time on any link this daemon sits on. Fresh float data packs barely (about 1.1x), so 1.25 stays
# clear of it when a sample runs a little high; token ids and sparse XORs pack well above it.
MIN_SAMPLE_RATIO = 1.25
# The sample is spread over the payload so that a change confined to one end (the first rows
# rewritten, the rest untouched) does not decide for all of it.
SAMPLE_WINDOWS = 8
SAMPLE_WINDOW_BYTES = 8 << 10
SAMPLE_BYTES = SAMPLE_WINDOWS * SAMPLE_WINDOW_BYTES


def pack(name: str, kind: str, meta: Callable[..., PayloadMeta], payload: np.ndarray) -> FieldDelta:
    """The delta carrying `payload`, packed if that pays; `meta` makes its meta from the codec and size."""
    squeezed = squeeze(payload)
    if squeezed is None:
        return FieldDelta(name, kind, meta(codec="raw", nbytes=payload.size), payload.tobytes())
    return FieldDelta(name, kind, meta(codec="zstd", nbytes=payload.size), squeezed)


def squeeze(payload: np.ndarray) -> bytes | None:
    """The payload as a zstd frame, or None when that would not be smaller (or not worth it)."""
    if payload.size > SAMPLE_BYTES and sample_ratio(payload) < MIN_SAMPLE_RATIO:
        return None
    frame = safe_zstd.compress(payload, COMPRESSION_LEVEL)
    return frame if len(frame) < payload.size else None


IDENTICAL = object()   # what squeeze_xor returns when the two arrays are bit-identical


def squeeze_xor(old_bytes: np.ndarray, new_bytes: np.ndarray):
    """`squeeze` of old XOR new (a payload larger than the sample), or IDENTICAL, without
    making the XOR in one piece: it is made and packed window by window."""
    windows = _sample_windows(new_bytes.size)
    sample = np.concatenate([np.bitwise_xor(old_bytes[w], new_bytes[w]) for w in windows])
    if _ratio(sample) < MIN_SAMPLE_RATIO:
        # Not worth packing. The arrays differ: a sample of XOR zeros packs far better than this.
        return None
    changed = []
    frame = safe_zstd.compress_chunks(_xor_windows(old_bytes, new_bytes, changed), new_bytes.size,
                                      XOR_COMPRESSION_LEVEL, threads=XOR_COMPRESSION_THREADS)
    if not changed:
        return IDENTICAL
    return frame if len(frame) < new_bytes.size else None


def _xor_windows(old_bytes: np.ndarray, new_bytes: np.ndarray, changed: list):
    """old XOR new in windows of one reused buffer (each valid until the next is asked for);
    appends True to `changed` once a window holds a set bit."""
    old_words, new_words = words(old_bytes), words(new_bytes)
    step = max(XOR_WINDOW_BYTES // old_words.itemsize, 1)
    buffer = np.empty(min(step, old_words.size), old_words.dtype)
    for at in range(0, old_words.size, step):
        window = buffer[:min(step, old_words.size - at)]
        np.bitwise_xor(old_words[at:at + window.size], new_words[at:at + window.size], out=window)
        if not changed and window.any():
            changed.append(True)
        yield window


def _sample_windows(size: int) -> list[slice]:
    step = size // SAMPLE_WINDOWS
    return [slice(i * step, i * step + SAMPLE_WINDOW_BYTES) for i in range(SAMPLE_WINDOWS)]


def sample_ratio(payload: np.ndarray) -> float:
    return _ratio(np.concatenate([payload[w] for w in _sample_windows(payload.size)]))


def _ratio(sample: np.ndarray) -> float:
    return sample.size / len(safe_zstd.compress(sample, COMPRESSION_LEVEL))
