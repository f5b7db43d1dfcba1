"""Field deltas: how one named field of a context changes, encoded small for the wire.

Both sides use this package: a client diffs a field against its last synced copy and sends the
delta; the daemon applies it (and diffs the other way for `get since version`). A field's value
is a numpy array of a numeric dtype, bytes, str, or a scalar (None, bool, int, float).

A delta is (name, kind, meta, data). `data` is the payload and travels as its own ZMQ frame;
`meta` is a small msgpack map describing it, typed per kind in protocol/change_entry.py:

| kind   | value  | meta                                                        | payload          |
|--------|--------|-------------------------------------------------------------|------------------|
| set    | array  | type "array", dtype, shape, codec, nbytes                   | the array, C order |
| set    | bytes  | type "bytes", codec, nbytes                                 | the bytes        |
| set    | str    | type "str", codec, nbytes                                   | UTF-8            |
| set    | scalar | type "scalar", value (nil, bool, int or float)              | none             |
| append | array  | as set; shape is the added rows' (same trailing dims)       | the added rows   |
| append | bytes, str | as set                                                  | the added suffix |
| xor    | array  | as set; dtype and shape equal the base's                    | base bytes XOR new bytes |
| delete | —      | {}                                                          | none             |

dtype is numpy's `dtype.str` ("<f4", "|u1", "|b1", ...) of bool, int8..int64, uint8..uint64,
float16, float32 or float64, either byte order. codec is "raw" or "zstd" (one zstd frame that
states its content size); nbytes is the payload's size after decoding.

The package's parts: field.py (the value types and shared checks), diff.py (the sender's side),
compress.py (when zstd pays, and packing), apply.py (the receiver's side, hostile input),
wire.py (entries and payload frames).
"""
from mcpd.protocol.delta.apply import apply, apply_in_place
from mcpd.protocol.delta.diff import delete, diff
from mcpd.protocol.delta.field import ALLOWED_DTYPES, DELETED, DeltaError, DeltaLimits, FieldDelta
from mcpd.protocol.delta.wire import from_wire, to_wire

__all__ = ["ALLOWED_DTYPES", "DELETED", "DeltaError", "DeltaLimits", "FieldDelta", "apply", "apply_in_place",
           "delete", "diff", "from_wire", "to_wire"]
