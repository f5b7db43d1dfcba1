"""Bounded zstd decompression: the output of a peer's frame never exceeds a cap we choose.

A zstd frame header states its decompressed size, and `ZstdDecompressor().decompress()` allocates
whatever that header says (ignoring `max_output_size`), so a 20-byte frame can ask for terabytes.
Here the header is read first and checked against the cap; frames that state no size are
streamed in bounded chunks and dropped the moment their output passes the cap. Exactly one
standard frame is accepted: skippable frames, a second frame or trailing bytes are rejected,
so a payload cannot smuggle data past the checks of whoever reads it.
"""
from __future__ import annotations

import zstandard

STREAM_CHUNK_BYTES = 1 << 20
# A frame of unknown size makes zstd allocate its declared window up front. Windows above the
# cap buy nothing, but encoders pick windows without knowing the size (zstd level 19 streams use
# 8 MiB), so the floor keeps such frames decodable; the ceiling is zstd's own default limit.
MIN_WINDOW_BYTES = 1 << 23
MAX_WINDOW_BYTES = 1 << 27


class DecompressionRejected(ValueError):
    """The frame is corrupt, not a single zstd frame, or decompresses to more than allowed."""


def compress(data: bytes | memoryview, level: int = 3) -> bytes:
    """One zstd frame whose header states the content size (so `decompress` can check it first)."""
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data)


def decompress(frame: bytes | memoryview, max_output: int) -> bytes:
    """The content of one zstd frame of at most `max_output` bytes; raises DecompressionRejected."""
    declared = _declared_size(frame)
    if declared > max_output:
        raise DecompressionRejected(f"frame declares {declared} bytes; at most {max_output} allowed")
    try:
        if declared > 0:
            # zstd writes into a buffer of exactly the declared size and fails on any other size.
            return zstandard.ZstdDecompressor().decompress(frame, allow_extra_data=False)
        # Unknown size, or 0: the single-shot call returns b"" for a declared 0 without decoding
        # (hiding trailing data), so both take the streaming path.
        return _stream(frame, max_output)
    except zstandard.ZstdError as e:
        raise DecompressionRejected(f"corrupt frame: {e}") from None


def _declared_size(frame: bytes | memoryview) -> int:
    """The header's content size, or -1 when the header states none."""
    if bytes(frame[:4]) != zstandard.MAGIC_NUMBER.to_bytes(4, "little"):
        raise DecompressionRejected("not a zstd frame (bad magic number)")
    try:
        return zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise DecompressionRejected(f"corrupt frame header: {e}") from None


def _stream(frame: bytes | memoryview, max_output: int) -> bytes:
    """Decode a frame of unstated size: measure it in bounded chunks first, keep it only if it fits."""
    _check_streamed_size(frame, max_output)
    # The frame is now known to fit; decode it again to learn whether input is left over, which
    # the bounded reader cannot tell.
    decoder = _decompressor(max_output).decompressobj()
    content = decoder.decompress(frame)
    if not decoder.eof:
        raise DecompressionRejected("truncated frame")
    if decoder.unused_data:
        raise DecompressionRejected(f"{len(decoder.unused_data)} bytes after the end of the frame")
    return content


def _check_streamed_size(frame: bytes | memoryview, max_output: int) -> None:
    produced = 0
    reader = _decompressor(max_output).stream_reader(frame, read_across_frames=False)
    while chunk := reader.read(STREAM_CHUNK_BYTES):
        produced += len(chunk)
        if produced > max_output:
            raise DecompressionRejected(f"frame decompresses to over {max_output} bytes")


def _decompressor(max_output: int) -> zstandard.ZstdDecompressor:
    window = 1 << max(max_output - 1, 1).bit_length()
    return zstandard.ZstdDecompressor(
        max_window_size=min(MAX_WINDOW_BYTES, max(MIN_WINDOW_BYTES, window)))
