"""How one generate request samples: its fields, defaults and bounds declared once.

The front-end decodes a client's sampling arguments into this struct (`decode`), once; the
scheduler may shorten it (`capped`), and the engine reads it as it is. Every integer has both
bounds: msgpack carries ints up to 2^64-1, and a value that passed here but overflowed the
engine's int64 tensors would crash a worker (top_k = 2^63, say).
"""
from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.limits import LimitsConfig

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_TOKEN_ID = (1 << 31) - 1
MAX_TOP_K = (1 << 31) - 1     # any top_k at or above the vocabulary size means "off"
MAX_STOPS = 16
MAX_STOP_CHARS = 256

TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """A field left out takes its default; omitted defaults keep the internal messages short."""
    max_tokens: Annotated[int, Meta(ge=1, le=INT64_MAX)] = 16   # and <= limits.max_new_tokens
    temperature: Annotated[float, Meta(ge=0, le=100)] = 1.0     # 0 = greedy
    top_k: Annotated[int, Meta(ge=0, le=MAX_TOP_K)] = 0          # 0 = off
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    seed: Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)] | None = None   # same seed, same tokens
    stop: Annotated[tuple[StopString, ...], Meta(max_length=MAX_STOPS)] = ()
    stop_token_ids: Annotated[tuple[TokenId, ...], Meta(max_length=MAX_STOPS)] = ()
    ignore_eos: bool = False
    logprobs: bool = False        # the logprob of each chosen token

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def capped(self, cap: int) -> SamplingParams:
        """These parameters with max_tokens shortened to cap (the degradation ladder's)."""
        return msgspec.structs.replace(self, max_tokens=cap)


FIELDS = SamplingParams.__struct_fields__


def decode(op: str, args: dict, limits: LimitsConfig) -> SamplingParams:
    """The sampling fields of a client's args map (nil = the default), or MCPDError naming the bad one."""
    given = {name: args[name] for name in FIELDS if args.get(name) is not None}
    try:
        params = msgspec.convert(given, SamplingParams)
    except msgspec.ValidationError as e:   # its message names the argument: "... - at `$.top_k`"
        raise MCPDError(codes.BAD_REQUEST, f"{op}: {e}") from None
    if params.max_tokens > limits.max_new_tokens:
        raise MCPDError(codes.BAD_REQUEST, f"{op}: argument 'max_tokens' must be between 1 and {limits.max_new_tokens}")
    return params
