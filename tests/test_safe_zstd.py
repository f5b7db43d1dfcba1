"""Bounded zstd decompression against hostile frames: bombs, lies, truncation, trailing data.

Several frames are written by hand from the format (RFC 8878) so that the tests do not depend on
what a particular compressor chooses to emit.
"""
import io
import tracemalloc

import pytest
import zstandard

from mcpd.protocol.safe_zstd import DecompressionRejected, compress, compress_chunks, decompress, decompress_chunks

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


NOT_FRAMES = pytest.mark.parametrize("frame", [
    b"",
    b"\x28\xb5",
    MAGIC,
    b"not zstd at all",
    b"\x50\x2a\x4d\x18" + (4).to_bytes(4, "little") + b"abcd",   # a skippable frame
    MAGIC + b"\xff" * 16,
], ids=["empty", "short", "magic only", "text", "skippable", "bad header"])


@NOT_FRAMES
def test_not_a_frame_is_rejected(frame):
    with pytest.raises(DecompressionRejected):
        decompress(frame, 1 << 20)


def test_rejection_is_a_value_error():
    assert issubclass(DecompressionRejected, ValueError)


# ------------------------------------------------------------------------------- in chunks

def joined(frame, exact_size: int, chunk: int = 1000) -> bytes:
    pieces = []
    for piece in decompress_chunks(frame, exact_size, chunk):
        assert 0 < len(piece) <= chunk
        pieces.append(bytes(piece))
    return b"".join(pieces)


@pytest.mark.parametrize("data", [b"", b"x", b"hello world " * 1000, bytes(range(256)) * 512])
@pytest.mark.parametrize("chunk", [1, 999, 1 << 20])
def test_chunks_round_trip(data, chunk):
    if chunk == 1 and len(data) > 20_000:
        data = data[:20_000]
    assert joined(compress(data), len(data), chunk) == data
    assert joined(memoryview(streamed(data)), len(data), chunk) == data
    assert joined(rle_frame(3), 3 * BLOCK, chunk) == b"A" * (3 * BLOCK)


@pytest.mark.parametrize("threads", [0, 2])
def test_compress_chunks_states_the_size_and_round_trips(threads):
    parts = [b"a" * 1000, memoryview(b"b" * 10), bytes(range(256)) * 40, b""]
    data = b"".join(bytes(p) for p in parts)
    frame = compress_chunks(parts, len(data), level=1, threads=threads)
    assert zstandard.frame_content_size(frame) == len(data)
    assert decompress(frame, len(data)) == data == joined(frame, len(data))


@pytest.mark.parametrize("size", [10, 12])
def test_compress_chunks_refuses_chunks_that_miss_the_pledged_size(size):
    with pytest.raises(ValueError):
        compress_chunks([b"x" * 11], size)


def test_chunks_refuse_a_declared_size_other_than_the_exact_one_before_decoding():
    bomb = rle_frame(1, content_size=1 << 40)

    def attempt():
        with pytest.raises(DecompressionRejected, match="declares"):
            decompress_chunks(bomb, 1 << 20)
    assert peak_bytes_during(attempt) < 1 << 16
    with pytest.raises(DecompressionRejected, match="declares"):
        decompress_chunks(compress(b"x" * 100), 101)


def test_chunked_bomb_of_unknown_size_is_stopped_at_the_exact_size():
    bomb = rle_frame(8192)    # 32 KiB that inflate to 1 GiB
    size = 8 << 20

    def attempt():
        with pytest.raises(DecompressionRejected, match="over"):
            for _ in decompress_chunks(bomb, size, 1 << 20):
                pass
    assert peak_bytes_during(attempt) < size // 2


@pytest.mark.parametrize("make", [compress, streamed], ids=["sized", "streamed"])
def test_chunks_refuse_content_shorter_or_longer_than_the_exact_size(make):
    data = b"0123456789" * 1000
    for size in (len(data) - 1, len(data) + 1):
        with pytest.raises(DecompressionRejected):
            joined(make(data), size)


@pytest.mark.parametrize("blocks,declared", [(3, 0), (3, 2 * BLOCK), (2, 3 * BLOCK)],
                         ids=["declares 0", "declares less", "declares more"])
def test_chunks_refuse_a_header_that_lies_about_the_content(blocks, declared):
    with pytest.raises(DecompressionRejected):
        joined(rle_frame(blocks, content_size=declared), declared)


@pytest.mark.parametrize("make", [compress, streamed], ids=["sized", "streamed"])
def test_chunks_refuse_a_truncated_frame(make):
    data = bytes(range(256)) * 64
    frame = make(data)
    for cut in (1, 3, len(frame) // 2, len(frame) - 6):
        with pytest.raises(DecompressionRejected):
            joined(frame[:-cut], len(data))
    with pytest.raises(DecompressionRejected, match="truncated"):
        joined(rle_frame(2, last=False), 2 * BLOCK)


@pytest.mark.parametrize("make", [compress, streamed], ids=["sized", "streamed"])
@pytest.mark.parametrize("tail", [b"\x00", b"garbage", None], ids=["zero", "garbage", "second frame"])
def test_chunks_refuse_trailing_data(make, tail):
    data = b"payload " * 100
    frame = make(data)
    with pytest.raises(DecompressionRejected):
        joined(frame + (frame if tail is None else tail), len(data))
    with pytest.raises(DecompressionRejected):
        joined(compress(b"") + b"hidden", 0)


def test_chunks_refuse_a_checksum_cut_off_or_wrong():
    data = bytes(range(256)) * 64
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(data)
    assert joined(frame, len(data)) == data
    with pytest.raises(DecompressionRejected, match="truncated"):
        joined(frame[:-1], len(data))
    with pytest.raises(DecompressionRejected):
        joined(frame[:-1] + bytes([frame[-1] ^ 1]), len(data))


def test_chunks_refuse_a_reserved_block_type():
    frame = bytearray(rle_frame(2))
    frame[6] |= 0b110
    with pytest.raises(DecompressionRejected):
        joined(bytes(frame), 2 * BLOCK)


@NOT_FRAMES
def test_chunks_refuse_what_is_not_a_frame(frame):
    with pytest.raises(DecompressionRejected):
        joined(frame, 16)
