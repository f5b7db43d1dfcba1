"""The three fields of a request's header that the door reads while the request's class is shed
(core.py's _shed_early): decoded alone into a struct, the rest of the header skipped unchecked,
at about a tenth of a full decode's cost; under a flood the front-end decodes mostly these. A
header that does not decode to them (not a map, a key not a string, a field of the wrong type,
bytes left over, nesting too deep) is left to the full parse, which names what is wrong."""
from __future__ import annotations

import msgspec


class ShedHeader(msgspec.Struct, frozen=True):
    op: str
    id: int | str
    priority: str | None = None


_DECODER = msgspec.msgpack.Decoder(ShedHeader)


def peek(raw: bytes) -> ShedHeader | None:
    """The header's op, id and priority (a repeated key: its last value, as the full parse reads
    it); None when they do not decode."""
    try:
        return _DECODER.decode(raw)
    except (ValueError, RecursionError):   # msgspec's DecodeError is a ValueError; RecursionError: nested too deep
        return None
