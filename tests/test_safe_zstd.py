"""Bounded zstd decompression against hostile frames: bombs, lies, truncation, trailing data.

Several frames are written by hand from the format (RFC 8878) so that the tests do not depend on
what a particular compressor chooses to emit.
"""
import io
import tracemalloc

import pytest
import zstandard

from mcpd.protocol.safe_zstd import DecompressionRejected, compress, decompress

MAGIC = zstandard.MAGIC_NUMBER.to_bytes(4, "little")
BLOCK = 128 << 10


def rle_frame(blocks: int, *, content_size: int | None = None, last: bool = True) -> bytes:
    """A frame of `blocks` RLE blocks of 128 KiB of b"A" each: 4 bytes of input per 128 KiB out."""
    if content_size is None:
        header = bytes([0x00, (17 - 10) << 3])    # no content size; window 2**17
    else:
        header = bytes([0xE0]) + content_size.to_bytes(8, "little")   # single segment, 8-byte size
    body = bytearray()
    for i in range(blocks):
        is_last = last and i == blocks - 1
        body += ((BLOCK << 3) | (1 << 1) | is_last).to_bytes(3, "little") + b"A"
    return MAGIC + header + bytes(body)


def streamed(data: bytes, level: int = 3) -> bytes:
    """A frame as a streaming encoder writes it: no content size in the header."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=level).stream_writer(out, closefd=False) as writer:
        writer.write(data)
    return out.getvalue()


def peak_bytes_during(call) -> int:
    tracemalloc.start()
    try:
        call()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize("data", [b"", b"x", b"hello world " * 1000, bytes(range(256)) * 512])
def test_round_trip_states_the_size(data):
    frame = compress(data)
    assert zstandard.frame_content_size(frame) == len(data)
    assert decompress(frame, len(data)) == data
    assert decompress(memoryview(frame), len(data) + 10) == data


def test_streamed_frame_of_unknown_size_round_trips():
    data = b"token " * 200_000
    frame = streamed(data)
    assert zstandard.frame_content_size(frame) == -1
    assert decompress(frame, len(data)) == data


def test_hand_made_frame_decodes_as_the_format_says():
    assert decompress(rle_frame(3), 3 * BLOCK) == b"A" * (3 * BLOCK)
    assert decompress(rle_frame(3, content_size=3 * BLOCK), 3 * BLOCK) == b"A" * (3 * BLOCK)


def test_declared_size_over_the_cap_is_rejected_before_allocating():
    bomb = rle_frame(1, content_size=1 << 40)    # claims a terabyte

    def attempt():
        with pytest.raises(DecompressionRejected, match="declares"):
            decompress(bomb, 1 << 20)
    assert peak_bytes_during(attempt) < 1 << 16


def test_bomb_of_unknown_size_is_stopped_near_the_cap():
    bomb = rle_frame(8192)    # 32 KiB that inflate to 1 GiB
    cap = 8 << 20

    def attempt():
        with pytest.raises(DecompressionRejected, match="over"):
            decompress(bomb, cap)
    assert peak_bytes_during(attempt) < cap // 2   # streamed in chunks: not even the cap is held


def test_output_one_byte_over_the_cap_is_rejected():
    data = b"0123456789" * 1000
    with pytest.raises(DecompressionRejected):
        decompress(compress(data), len(data) - 1)
    with pytest.raises(DecompressionRejected):
        decompress(streamed(data), len(data) - 1)


def test_size_in_header_smaller_than_content_is_rejected():
    # Declares 0 bytes but holds 384 KiB: zstd must not be trusted to skip the body.
    with pytest.raises(DecompressionRejected):
        decompress(rle_frame(3, content_size=0), 1 << 20)


def test_size_in_header_larger_than_content_is_rejected():
    with pytest.raises(DecompressionRejected):
        decompress(rle_frame(2, content_size=3 * BLOCK), 1 << 20)


@pytest.mark.parametrize("make", [compress, streamed], ids=["sized", "streamed"])
def test_truncated_frame_is_rejected(make):
    frame = make(bytes(range(256)) * 64)
    for cut in (1, 3, len(frame) // 2, len(frame) - 6):
        with pytest.raises(DecompressionRejected):
            decompress(frame[:-cut], 1 << 20)


def test_frame_without_its_last_block_is_rejected():
    with pytest.raises(DecompressionRejected, match="truncated"):
        decompress(rle_frame(2, last=False), 1 << 20)


@pytest.mark.parametrize("make", [compress, streamed], ids=["sized", "streamed"])
@pytest.mark.parametrize("tail", [b"\x00", b"garbage", None], ids=["zero", "garbage", "second frame"])
def test_trailing_data_is_rejected(make, tail):
    frame = make(b"payload " * 100)
    with pytest.raises(DecompressionRejected):
        decompress(frame + (frame if tail is None else tail), 1 << 20)


def test_trailing_data_after_an_empty_frame_is_rejected():
    with pytest.raises(DecompressionRejected):
        decompress(compress(b"") + b"hidden", 1 << 20)


@pytest.mark.parametrize("frame", [
    b"",
    b"\x28\xb5",
    MAGIC,
    b"not zstd at all",
    b"\x50\x2a\x4d\x18" + (4).to_bytes(4, "little") + b"abcd",   # a skippable frame
    MAGIC + b"\xff" * 16,
], ids=["empty", "short", "magic only", "text", "skippable", "bad header"])
def test_not_a_frame_is_rejected(frame):
    with pytest.raises(DecompressionRejected):
        decompress(frame, 1 << 20)


def test_rejection_is_a_value_error():
    assert issubclass(DecompressionRejected, ValueError)
