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


def compress_chunks(chunks, size: int, level: int = 3, threads: int = 0) -> bytes:
    """One zstd frame stating the content size `size`, packed from `chunks` (buffers) as they come,
    so the content never has to exist in one piece. `threads` worker threads pack while the
    caller makes the next chunk. Raises ValueError when the chunks do not add up to `size`."""
    compressor = zstandard.ZstdCompressor(level=level, threads=threads, write_content_size=True)
    packer = compressor.compressobj(size=size)
    parts, total = [], 0
    try:
        for chunk in chunks:
            total += memoryview(chunk).nbytes
            if total > size:
                raise ValueError(f"chunks add up to over the pledged {size} bytes")
            parts.append(packer.compress(chunk))
        if total != size:
            raise ValueError(f"chunks add up to {total} bytes; {size} pledged")
        parts.append(packer.flush())
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd could not pack the chunks: {e}") from None
    return b"".join(parts)


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


def decompress_chunks(frame: bytes | memoryview, exact_size: int, chunk: int = STREAM_CHUNK_BYTES):
    """The content of one zstd frame of exactly `exact_size` bytes, in pieces of at most `chunk`
    bytes, so that no buffer of the whole content is ever made; raises DecompressionRejected.

    Checks as `decompress` does: the frame alone must fill the input (no trailing bytes, no second
    frame, not truncated) and its content must be exactly `exact_size` bytes. The framing is
    checked before any output; corrupt blocks raise while streaming, so a caller must not use what
    it built from earlier pieces when this raises. Each piece is a memoryview of one reused buffer,
    valid only until the next piece is asked for.
    """
    if exact_size < 0 or chunk < 1:
        raise ValueError("exact_size must be >= 0 and chunk >= 1")
    declared = _declared_size(frame)
    if declared != -1 and declared != exact_size:
        raise DecompressionRejected(f"frame declares {declared} bytes; exactly {exact_size} expected")
    _check_single_frame(frame)
    return _chunks(frame, exact_size, chunk)


def _chunks(frame: bytes | memoryview, exact_size: int, chunk: int):
    buffer = bytearray(min(chunk, max(exact_size, 1)))
    view = memoryview(buffer)
    produced = 0
    try:
        with _decompressor(exact_size).stream_reader(frame, read_across_frames=False) as reader:
            while produced < exact_size:
                want = min(len(buffer), exact_size - produced)
                got = reader.readinto(view[:want])
                if got == 0:
                    raise DecompressionRejected(f"frame ends after {produced} bytes; {exact_size} expected")
                produced += got
                yield view[:got]
            # Decodes the rest of the frame (its last block, its checksum), which must add nothing.
            if reader.read(1):
                raise DecompressionRejected(f"frame decompresses to over {exact_size} bytes")
    except zstandard.ZstdError as e:
        raise DecompressionRejected(f"corrupt frame: {e}") from None


def _check_single_frame(frame: bytes | memoryview) -> None:
    """Walk the frame's block headers (RFC 8878 3.1.1.2): the frame must end exactly where the
    input does. The streaming decoder stops at the frame's end without saying what is left over,
    nor whether the input ran out before the frame did."""
    view = memoryview(frame).cast("B")
    try:
        at = zstandard.frame_header_size(view)
    except zstandard.ZstdError as e:
        raise DecompressionRejected(f"corrupt frame header: {e}") from None
    has_checksum = bool(view[4] & 0x04)
    while True:
        if at + 3 > len(view):
            raise DecompressionRejected("truncated frame")
        header = view[at] | view[at + 1] << 8 | view[at + 2] << 16
        last, block_type, size = header & 1, (header >> 1) & 3, header >> 3
        if block_type == 3:
            raise DecompressionRejected("corrupt frame: reserved block type")
        at += 3 + (1 if block_type == 1 else size)
        if last:
            break
    at += 4 if has_checksum else 0
    if at > len(view):
        raise DecompressionRejected("truncated frame")
    if at < len(view):
        raise DecompressionRejected(f"{len(view) - at} bytes after the end of the frame")
