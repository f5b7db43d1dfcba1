"""Wire protocol v1: how a request and its replies are laid out in ZeroMQ multipart messages.

A request is `[header, *payload]` (a REQ socket adds an empty delimiter first; it is echoed back).
The header is a msgpack map: {"v": 1, "op": str, "id": int|str, "args": map, ...}. Replies are
`[header, *payload]` with kind "chunk" (zero or more, streaming), then exactly one "ok" or "error".
docs/PROTOCOL.md is the normative description; keep the two in step.

Everything here treats its input as hostile: sizes are checked before decoding, msgpack runs
with hard container limits, and nothing is allocated on the strength of a length the peer wrote.
"""
from __future__ import annotations

import msgpack
import msgspec

from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.error import ErrorReply
from mcpd.protocol.limits import LimitsConfig
from mcpd.protocol.results import GenerateChunk

VERSION = 1
SUPPORTED_VERSIONS = (1,)
MAX_ID_CHARS = 64
MAX_MAP_ITEMS = 4096         # per msgpack map in a header
MAX_REPLY_ITEMS = 1 << 22    # client side: token ids and logprobs of a long generation
MAX_STR_BYTES = 1 << 20      # one string in a header (a prompt); the header cap bounds the total
MAX_TIMEOUT_MS = (1 << 63) - 1   # what an int64 holds: every integer the daemon takes is bounded
_ENCODER = msgspec.msgpack.Encoder()


class Request(msgspec.Struct, frozen=True):
    """A request whose envelope and header passed validation (args are checked per op); a struct
    because one is built per client message."""
    envelope: tuple[bytes, ...]   # () for DEALER peers, (b"",) for REQ peers
    header: dict
    payload: tuple[bytes, ...]
    op: str                 # the header's, read once
    request_id: int | str


def parse_request(envelope: tuple[bytes, ...], frames: list[bytes], limits: LimitsConfig,
                  sizes: list[int] | None = None) -> Request:
    """Validate a client message (identity and envelope already split off). Raises MCPDError.
    `sizes`: its frames' sizes as received, where frames past the size limits were dropped on
    reading (by default, those of `frames`).

    When the error is raised after the header decoded, `e.request_id` holds the client's id so
    the reply can still name the request.
    """
    check_sizes([len(f) for f in frames] if sizes is None else sizes, limits)
    header_bytes = frames[0]
    if len(header_bytes) > limits.max_header_bytes:
        raise MCPDError(codes.TOO_LARGE,
                        f"header is {len(header_bytes)} bytes; the limit is {limits.max_header_bytes}")
    # Arrays may be as long as the longest prompt in token ids; the header cap bounds the bytes.
    header = decode_header(header_bytes, max_array_len=max(MAX_MAP_ITEMS, limits.max_prompt_tokens))
    request_id = header.get("id")
    try:
        _check_header(header)
    except MCPDError as e:
        e.request_id = request_id if valid_id(request_id) else None
        raise
    return Request(envelope, header, tuple(frames[1:]), header["op"], request_id)


def check_sizes(frame_sizes: list[int], limits: LimitsConfig) -> None:
    """The size checks of a request's frames (envelope split off), made before anything is decoded."""
    if not frame_sizes:
        raise MCPDError(codes.BAD_REQUEST, "message has no header frame")
    if len(frame_sizes) > limits.max_frames:
        raise MCPDError(codes.TOO_LARGE, f"{len(frame_sizes)} frames; the limit is {limits.max_frames}")
    total = sum(frame_sizes)
    if total > limits.max_message_bytes:
        raise MCPDError(codes.TOO_LARGE, f"message is {total} bytes; the limit is {limits.max_message_bytes}")


def split_envelope(frames: list[bytes]) -> tuple[tuple[bytes, ...], list[bytes]]:
    """Split off a REQ socket's empty delimiter frame (DEALER peers send none); it is echoed back."""
    if frames and frames[0] == b"":
        return (b"",), frames[1:]
    return (), frames


def decode_header(raw: bytes, max_array_len: int = MAX_MAP_ITEMS) -> dict:
    """msgpack-decode a header with hard limits; anything but a map with str keys is rejected."""
    try:
        header = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, use_list=True,
            max_str_len=MAX_STR_BYTES, max_bin_len=MAX_STR_BYTES, max_array_len=max_array_len,
            max_map_len=MAX_MAP_ITEMS, max_ext_len=0)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        if "exceeds max_" in str(e):   # one of the bounds above: say which, not that the encoding is bad
            raise MCPDError(codes.BAD_REQUEST, f"header holds too much in one value ({e}): an array at most "
                                               f"{max_array_len} items (a prompt's token ids: limits.max_prompt_tokens), "
                                               f"a map {MAX_MAP_ITEMS}, a string {MAX_STR_BYTES} bytes") from None
        raise MCPDError(codes.BAD_REQUEST, f"header is not valid msgpack: {e}") from None
    if not isinstance(header, dict):
        raise MCPDError(codes.BAD_REQUEST, f"header must be a msgpack map, got {type(header).__name__}")
    return header


def _check_header(header: dict) -> None:
    version = header.get("v")
    if type(version) is not int:
        raise MCPDError(codes.BAD_REQUEST, 'header field "v" (protocol version) must be an integer')
    if version not in SUPPORTED_VERSIONS:
        raise MCPDError(codes.UNSUPPORTED_VERSION,
                        f"protocol version {version} is not supported; this daemon speaks {list(SUPPORTED_VERSIONS)}")
    if not valid_id(header.get("id")):
        raise MCPDError(codes.BAD_REQUEST,
                        f'header field "id" must be an integer >= 0 or a string of 1..{MAX_ID_CHARS} characters')
    if not isinstance(header.get("op"), str):
        raise MCPDError(codes.BAD_REQUEST, 'header field "op" must be a string')
    if not isinstance(header.setdefault("args", {}), dict):
        raise MCPDError(codes.BAD_REQUEST, 'header field "args" must be a map')
    tenant = header.get("tenant")
    if tenant is not None and not (isinstance(tenant, str) and 0 < len(tenant) <= MAX_ID_CHARS):
        raise MCPDError(codes.BAD_REQUEST, f'header field "tenant" must be a string of 1..{MAX_ID_CHARS} characters')
    hop = header.get("hop")   # a node's id: the request was forwarded by that node (gate.py says who may)
    if hop is not None and not (isinstance(hop, str) and 0 < len(hop) <= MAX_ID_CHARS):
        raise MCPDError(codes.BAD_REQUEST, f'header field "hop" must be a node id of 1..{MAX_ID_CHARS} characters')
    priority = header.get("priority")   # the class name is the scheduler's to judge (it may reload)
    if priority is not None and not (isinstance(priority, str) and 0 < len(priority) <= MAX_ID_CHARS):
        raise MCPDError(codes.BAD_REQUEST, f'header field "priority" must be a class name of 1..{MAX_ID_CHARS} characters')
    timeout_ms = header.get("timeout_ms")
    if timeout_ms is not None and (type(timeout_ms) is not int or not 0 < timeout_ms <= MAX_TIMEOUT_MS):
        raise MCPDError(codes.BAD_REQUEST, f'header field "timeout_ms" must be an integer in 1..{MAX_TIMEOUT_MS}')


def valid_id(value) -> bool:
    if type(value) is int:
        return value >= 0
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS


def encode_request(op: str, request_id: int | str, args: dict | None = None, **fields) -> bytes:
    """The header frame of a request (used by the bundled clients and mcpctl)."""
    return msgpack.packb({"v": VERSION, "op": op, "id": request_id, "args": args or {}, **fields})


def ok_reply(request_id, result: dict | msgspec.Struct) -> bytes:
    """A final ok reply; a result struct (results.py) encodes as its map."""
    return _ENCODER.encode({"v": VERSION, "id": request_id, "kind": "ok", "result": result})


def chunk_reply(request_id, seq: int, data: GenerateChunk) -> bytes:
    return _ENCODER.encode({"v": VERSION, "id": request_id, "kind": "chunk", "seq": seq, "data": data})


def merge_chunks(first: bytes, then: bytes) -> bytes:
    """One chunk carrying both chunks' data (strings and arrays concatenate), with first's seq:
    how the front-end holds a stream's output for a client that is not reading (outbox.py)."""
    merged, data = msgpack.unpackb(first, raw=False), msgpack.unpackb(then, raw=False)["data"]
    for key, value in data.items():
        kept = merged["data"].get(key)
        merged["data"][key] = kept + value if isinstance(value, (str, list)) and type(kept) is type(value) else value
    return msgpack.packb(merged)


def renumber_chunk(chunk: bytes, shift: int) -> bytes:
    """The chunk with its seq moved down by `shift` (the number of its stream's chunks merged away)."""
    reply = msgpack.unpackb(chunk, raw=False)
    reply["seq"] -= shift
    return msgpack.packb(reply)


def error_reply(request_id, error: ErrorReply) -> bytes:
    """A final error reply: the error's fields flat in the header, retry_after_ms only when set."""
    reply = {"v": VERSION, "id": request_id, "kind": "error", "code": error.code, "message": error.message}
    if error.retry_after_ms is not None:
        reply["retry_after_ms"] = error.retry_after_ms
    return _ENCODER.encode(reply)


def decode_reply(raw: bytes) -> dict:
    """Client side: decode a reply header (the daemon is trusted less than fully: limits stay on)."""
    return decode_header(raw, max_array_len=MAX_REPLY_ITEMS)
