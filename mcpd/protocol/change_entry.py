"""A context update's change entries as the wire carries them (docs/PROTOCOL.md section 4,
contexts), declared once: a tagged union on `kind`, each kind with the metas it may carry, a meta
a tagged union on `type`.

The front-end decodes a client's entries into these (`decode`), so the scheduler reads typed
values; journal replay and clients decode theirs through delta/wire.from_wire. The payload frames
they index, and the checks against the field limits, are the delta package's (protocol/delta: wire.py, apply.py). Unknown keys are ignored, as unknown
header keys are, so a newer peer can add some. Kept apart from the delta package, which loads
numpy: the protocol's front-end side does not.
"""
from __future__ import annotations

from typing import Annotated, Union

import msgspec
from msgspec import Meta

from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError

MAX_NAME_CHARS = 256
FieldName = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_CHARS)]


class ScalarMeta(msgspec.Struct, frozen=True, tag_field="type", tag="scalar"):
    value: None | bool | int | float


class PayloadMeta(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """A value that travels in a payload frame: how it is packed and its size unpacked."""
    codec: str    # "raw" or "zstd"; delta/apply names any other
    nbytes: int


class BytesMeta(PayloadMeta, tag="bytes"):
    pass


class StrMeta(PayloadMeta, tag="str"):
    pass


class ArrayMeta(PayloadMeta, tag="array"):
    dtype: str               # numpy's dtype.str; delta/apply holds it to the allowed ones
    shape: tuple[int, ...]


class NoMeta(msgspec.Struct, frozen=True):
    """A delete's meta: `{}`."""


TextMeta = Union[BytesMeta, StrMeta]
ANY_META = Union[ScalarMeta, ArrayMeta, BytesMeta, StrMeta, NoMeta]


class ChangeEntry(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    name: FieldName
    frame: Annotated[int, Meta(ge=0)] | None = None   # the request's payload frame that holds the value

    @property
    def kind(self) -> str:
        return self.__struct_config__.tag


class SetEntry(ChangeEntry, tag="set"):
    meta: Union[ScalarMeta, ArrayMeta, BytesMeta, StrMeta]


class AppendEntry(ChangeEntry, tag="append"):
    meta: Union[ArrayMeta, BytesMeta, StrMeta]


class XorEntry(ChangeEntry, tag="xor"):
    meta: ArrayMeta


class DeleteEntry(ChangeEntry, tag="delete"):
    meta: NoMeta = NoMeta()


ANY_ENTRY = Union[SetEntry, AppendEntry, XorEntry, DeleteEntry]
BY_KIND: dict[str, type[ChangeEntry]] = {t.__struct_config__.tag: t for t in ANY_ENTRY.__args__}
_ENTRIES = tuple[ANY_ENTRY, ...]


class DeltaError(MCPDError, ValueError):
    """A delta that cannot be applied; `code` is BAD_REQUEST (malformed) or TOO_LARGE (over limits)."""


def decode(entries) -> tuple[ChangeEntry, ...]:
    """A peer's entries (as msgpack decoded them, or already typed) as typed entries; a malformed
    one is a BAD_REQUEST DeltaError naming where it is wrong ("... - at `$[0].meta.shape`")."""
    try:
        return msgspec.convert(entries, _ENTRIES)
    except msgspec.ValidationError as e:
        raise DeltaError(codes.BAD_REQUEST, f"changes: {e}") from None
