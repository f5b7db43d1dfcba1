"""The results of the control ops that run in the scheduler (control_ops.py's table), each a
msgspec Struct declared once.

The scheduler answers such an op with its struct in messages.AdminAnswer, tagged with its type,
and the supervisor decodes it as that type, checked, before relaying it to mcpctl as the map of
its fields (`as_map`): the tag is the internal message's alone.
"""
from __future__ import annotations

from typing import Union

import msgspec


class ControlResult(msgspec.Struct, frozen=True, tag_field="result_of", tag=True):
    pass


class ContextSummary(msgspec.Struct, frozen=True):
    """One context as `contexts.list` shows it (Context.describe(), with its owner and state)."""
    owner: str
    id: str
    version: int
    tokens: int
    fields: list[str]   # the names of its fields, its tokens aside
    bytes: int
    busy: bool          # a turn of it is running
    kv_version: str | None   # "model/version" whose KV its last turn left


class ContextField(msgspec.Struct, frozen=True):
    name: str
    type: str                  # the Python type of its value
    dtype: str | None          # an array's
    shape: list[int] | None    # an array's
    version: int               # the context version that last changed it


class ContextList(ControlResult):
    total: int                        # every context that matched, however many `contexts` holds
    contexts: list[ContextSummary]


class ContextDetail(ContextSummary, ControlResult):
    """`contexts.show`: the summary, its fields described one by one in place of their names."""
    fields: list[ContextField]


class ContextDropped(ControlResult):
    dropped: bool   # False: there was no such context


class TrafficPolicy(ControlResult):
    """Where a model's new requests go after promote, split or rollback (scheduler/traffic.py)."""
    model: str
    primary: str
    split: dict[str, float]   # version -> weight, as the operator gave them; {}: all to the primary


class ShadowSetting(ControlResult):
    model: str
    candidate: str | None   # None: the shadow is off
    fraction: float


class VersionState(ControlResult):
    """A version loaded or unloaded; the supervisor adds the workers it started or stopped."""
    model: str
    version: str
    loaded: bool


ANY = Union[ContextList, ContextDetail, ContextDropped, TrafficPolicy, ShadowSetting, VersionState]


def as_map(result: ControlResult) -> dict:
    """The result as mcpctl gets it: its fields (nested structs encode as their maps), no tag."""
    return msgspec.structs.asdict(result)
