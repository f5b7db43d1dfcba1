"""A context field kept as a sliding window of rows: an infer appends the rows of an input it sent,
and the field keeps the last `window` rows (daemon/scheduler/context_inputs.py). The rows must be
the field's kind of rows: the same dtype and the same shape after the first dim."""
from __future__ import annotations

import numpy as np

from mcpd.contexts.context import TOKENS
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError


def appended(field: str, old, rows: np.ndarray, input_name: str, window: int) -> np.ndarray:
    """The field's next value: its rows, then `rows`, the last `window` of them, as a fresh array
    (never a view of the request's frame, which the scheduler frees). BAD_INPUT naming both the
    input and the field when the rows cannot join it."""
    if field == TOKENS:
        raise MCPDError(codes.BAD_REQUEST, "the tokens field is the context's token history: only generate "
                                           "appends to it")
    _check_rows(rows, input_name)
    if old is None:
        old = rows[:0]
    _check_fits(field, old, rows, input_name)
    kept = old[max(0, len(old) - max(0, window - len(rows))):]
    return np.concatenate([kept, rows[-window:]], dtype=old.dtype)


def _check_rows(rows: np.ndarray, input_name: str) -> None:
    if rows.dtype == object:
        raise MCPDError(codes.BAD_INPUT, f"input {input_name!r} is BYTES: a context field holds numeric rows only")
    # A context keeps bools as bytes 0 and 1 (what a replay of its journal checks).
    if rows.dtype == np.bool_ and rows.view(np.uint8).max(initial=0) > 1:
        raise MCPDError(codes.BAD_INPUT, f"input {input_name!r}: BOOL bytes must be 0 or 1")


def _check_fits(field: str, old, rows: np.ndarray, input_name: str) -> None:
    if not isinstance(old, np.ndarray) or old.ndim == 0:
        raise MCPDError(codes.BAD_INPUT, f"context field {field!r} holds a {type(old).__name__} without rows: "
                                         f"input {input_name!r} cannot be appended to it")
    # dtype.str less its byte order: a field synced from a big-endian client still takes rows.
    if old.dtype.str[1:] != rows.dtype.str[1:] or old.shape[1:] != rows.shape[1:]:
        raise MCPDError(codes.BAD_INPUT, f"input {input_name!r} ({rows.dtype} rows of shape {list(rows.shape[1:])}) "
                                         f"cannot be appended to context field {field!r} ({old.dtype} rows of "
                                         f"shape {list(old.shape[1:])})")
