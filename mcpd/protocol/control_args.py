"""The arguments of the control ops (control_ops.py's table), each a msgspec Struct with its
bounds declared once.

The supervisor decodes a control request's "args" map into its op's struct (`decode`), once, and
the handler reads the fields; ops that run in the scheduler get the same value in
messages.Admin, tagged with its type. An argument the op does not declare is refused (as on the
client socket, PROTOCOL.md section 2), and a nil value is as if it were left out.
"""
from __future__ import annotations

import sys
from typing import Annotated, Union

import msgspec
from msgspec import Meta

from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.tenant import DEFAULT_TENANT

TenantName = Annotated[str, Meta(min_length=1, max_length=64)]    # as the header's `tenant` (section 2)
ContextId = Annotated[str, Meta(min_length=1, max_length=256)]
ModelName = Annotated[str, Meta(min_length=1, max_length=64)]     # as a name in [models] (config/models.py)
Weight = Annotated[float, Meta(ge=0, le=sys.float_info.max)]      # finite: inf would route every key to one version
LIST_LIMIT = 1000   # contexts one `contexts.list` returns when not told; the total is always given


class ControlArgs(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="args_of", tag=True):
    pass


class NoArgs(ControlArgs):
    pass


class WorkerIndex(ControlArgs):
    index: Annotated[int, Meta(ge=0, le=255)]


class ReloadTimeout(ControlArgs):
    timeout_s: Annotated[float, Meta(ge=0, le=3600)] | None = None   # None: the supervisor's own wait


class ContextListing(ControlArgs):
    owner: TenantName | None = None   # None: every tenant's
    limit: Annotated[int, Meta(ge=1, le=1_000_000)] = LIST_LIMIT


class ContextRef(ControlArgs):
    id: ContextId
    owner: TenantName = DEFAULT_TENANT


class ModelRef(ControlArgs):
    model: ModelName


class ModelVersion(ControlArgs):
    model: ModelName
    version: ModelName


class TrafficSplit(ControlArgs):
    model: ModelName
    weights: dict[ModelName, Weight]


class ShadowPlan(ControlArgs):
    model: ModelName
    version: ModelName | None = None   # None turns the shadow off
    fraction: Annotated[float, Meta(ge=0, le=1)] = 0.1


class KeyName(ControlArgs):
    name: str   # the key store checks its characters and says which are wrong


class KeyGrant(ControlArgs):
    name: str
    public_key: str


ANY = Union[NoArgs, WorkerIndex, ReloadTimeout, ContextListing, ContextRef, ModelRef, ModelVersion, TrafficSplit,
            ShadowPlan, KeyName, KeyGrant]


def decode(op: str, args: dict, kind: type[ControlArgs]) -> ControlArgs:
    """`args` as op's struct (nil = left out), or BAD_REQUEST naming the argument."""
    given = {name: value for name, value in args.items() if value is not None}
    try:
        return msgspec.convert(given, kind)
    except msgspec.ValidationError as e:   # its message names the argument: "... - at `$.index`"
        raise MCPDError(codes.BAD_REQUEST, f"control op {op!r}: {e}") from None
