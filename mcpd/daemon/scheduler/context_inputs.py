"""An infer's context fields made inputs, on the scheduler, which owns the contexts: the client
sends only what is new (a transaction), the daemon adds what it keeps (the user's profile, the
window of the user's last events). The worker then gets plain inputs and frames, as if sent.

- context_inputs {input: field}: the field of the tenant's context is read as the input.
- context_append {field: {input, window}}: the sent input's rows are appended to the field
  (created if absent), which keeps its last `window` rows and is committed as the context's next
  version through the store, as a context.update is (the journal, the host cache and a
  cluster's Redis hear it); the field, not the sent rows, is then that input.
The shape rule: a field used as an input is one row of it, [1, *the field's shape], repeated for
each row of the request's first other sent input (a profile [256] is [1, 256] alone, [n, 256]
beside n candidates; a window of events [w, 8] is [1, w, 8]). No handler's signature is needed
to read it, so a request is resolved the same before and after its model's workers started.
A context another tenant holds is NOT_FOUND, as for every context op. Reading does not wait for
a generate on the context (it changes only the tokens); an append is CONFLICT then, as an update
is. The append is committed at admission: a request that then fails or expires keeps it."""
from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from mcpd.contexts import field_window
from mcpd.contexts.store import ContextStore
from mcpd.daemon import model_stats
from mcpd.handlers import tensors
from mcpd.handlers.tensor_header import MAX_RANK, TensorHeader
from mcpd.handlers.tensors import TensorSpec
from mcpd.protocol import codes
from mcpd.protocol.args import InferArgs
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.limits import LimitsConfig


@dataclass(frozen=True)
class Resolved:
    args: InferArgs        # every input sent, none named by a context field
    payload: list[bytes]   # input i's bytes in frame i
    context_version: int   # the version the fields were read from (after the append)


def resolve(store: ContextStore, tenant: str, args: InferArgs, payload: list[bytes], limits: LimitsConfig,
            signature: model_stats.Signature | None) -> Resolved:
    """The args and frames the worker takes; the inputs made from fields are held to the limits
    of sent ones, and to the model's signature (None until a worker of it said hello). All is
    checked before the append is committed: a refusal changes nothing."""
    appends = args.context_append or {}
    field_of = _appended_inputs(appends)
    sent = {header.name: (header, frame) for header, frame in zip(args.inputs, payload)}
    context = store.writable(tenant, args.context, None) if appends else store.get(tenant, args.context)
    windows = {field: field_window.appended(field, context.fields.get(field), tensors.decode(*sent[append.input]),
                                            append.input, append.window)
               for field, append in appends.items()}
    fields = {**context.fields, **windows}
    values = {name: _one_row(args.context, field, name, fields)
              for name, field in {**field_of, **(args.context_inputs or {})}.items()}
    rows = next((header.shape[0] for header in args.inputs if header.name not in field_of), 1)
    _check_sizes(args.context, values, rows, limits)
    _check_signature(signature, values, rows)
    if windows:
        store.commit_fields(context, windows)
    headers, frames = zip(*(_repeated(name, values[name], rows) if name in values else sent[name]
                            for name in [*sent, *(args.context_inputs or ())]))
    resolved = msgspec.structs.replace(args, inputs=headers, context=None, context_inputs=None, context_append=None)
    return Resolved(resolved, list(frames), context.version)


def _check_sizes(context_id: str, values: dict[str, np.ndarray], rows: int, limits: LimitsConfig) -> None:
    """Before the rows are made: a field repeated for many sent rows, or a window grown over many
    requests, must not outgrow what a request may send."""
    made = sum(rows * value.nbytes for value in values.values())
    if made > limits.max_message_bytes:
        raise MCPDError(codes.TOO_LARGE, f"the inputs read from context {context_id!r} would be {made} bytes for "
                                         f"{rows} row(s); the limit is {limits.max_message_bytes} "
                                         "(limits.max_message_bytes)")
    for name, row in values.items():
        if rows * row.size > limits.max_tensor_elements:
            raise MCPDError(codes.BAD_INPUT, f"input {name!r}: {rows} row(s) of shape {list(row.shape[1:])} from "
                                             f"context {context_id!r} hold more than {limits.max_tensor_elements} "
                                             "elements (limits.max_tensor_elements)")


def _check_signature(signature: model_stats.Signature | None, values: dict[str, np.ndarray], rows: int) -> None:
    """The worker's checks of the inputs made from fields (handlers/tensors.py), run here too, so
    that no append is committed for a request the model refuses."""
    if signature is None:
        return
    declared = signature.inputs
    for name, row in values.items():
        if name not in declared:
            raise MCPDError(codes.BAD_INPUT, f"the model has no input {name!r}; its inputs: {', '.join(declared)}")
        spec = TensorSpec(declared[name].datatype, tuple(declared[name].shape))
        spec.check(name, np.broadcast_to(row, (rows, *row.shape[1:])))


def _repeated(name: str, row: np.ndarray, rows: int) -> tuple[TensorHeader, bytes]:
    return tensors.encode(name, np.broadcast_to(row, (rows, *row.shape[1:])))


def _appended_inputs(appends: dict) -> dict[str, str]:
    """input -> the field it is appended to; one field per input, since the field replaces it."""
    field_of = {}
    for field, append in appends.items():
        if append.input in field_of:
            raise MCPDError(codes.BAD_INPUT, f"input {append.input!r} is appended to two context fields "
                                             f"({field_of[append.input]!r}, {field!r}); it can stand for one")
        field_of[append.input] = field
    return field_of


def _one_row(context_id: str, field: str, name: str, fields: dict) -> np.ndarray:
    """The field as one row of input `name`; BAD_INPUT when it cannot be one."""
    if field not in fields:
        raise MCPDError(codes.BAD_INPUT, f"context {context_id!r} has no field {field!r} (for input {name!r})")
    value = fields[field]
    if not isinstance(value, np.ndarray):
        raise MCPDError(codes.BAD_INPUT, f"context field {field!r} holds a {type(value).__name__}, not a tensor: "
                                         f"it cannot be input {name!r}")
    try:
        tensors.datatype_of(value)
    except ValueError:
        raise MCPDError(codes.BAD_INPUT, f"context field {field!r} is {value.dtype}, which no input datatype is: "
                                         f"it cannot be input {name!r}") from None
    if value.ndim + 1 > MAX_RANK:
        raise MCPDError(codes.BAD_INPUT, f"context field {field!r} has {value.ndim} dims: as one row of input "
                                         f"{name!r} it would have {value.ndim + 1}; at most {MAX_RANK}")
    return value[np.newaxis]
