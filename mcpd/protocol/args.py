"""The arguments of each op of protocol v1 as frozen typed values, with their defaults.

ops.py checks a client's "args" map and builds one of these; from then on every process reads
the fields, never the map: nothing downstream checks types, ranges or defaults again. Each is a
msgspec Struct tagged with its op, so the internal messages carry it as it is (daemon/messages.py)
and the tag says which op a request is. A field left out (or nil) takes the default declared
here (a sampling field's in sampling.py), the only place a default lives.
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

from mcpd.handlers.tensor_header import TensorHeader
from mcpd.protocol.change_entry import ANY_ENTRY
from mcpd.protocol.sampling import SamplingParams


class ContextAppend(msgspec.Struct, frozen=True, array_like=True):
    """An infer's append to a context field: the sent input's rows, keeping the last `window`."""
    input: str
    window: int


class OpArgs(msgspec.Struct, frozen=True, array_like=True, tag_field="op"):
    @property
    def op(self) -> str:
        return self.__struct_config__.tag


class PingArgs(OpArgs, tag="ping"):
    pass


class StatusArgs(OpArgs, tag="status"):
    pass


class GenerateArgs(OpArgs, tag="generate"):
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    sampling: SamplingParams = SamplingParams()   # the sampling arguments, as the engine reads them
    stream: bool = False
    context: str | None = None   # run on this context's tokens and append the turn
    base: int | None = None      # with context: the version the turn expects
    model: str | None = None     # the model table's name (None: the default model)
    version: str | None = None   # one of its versions (None: as its traffic policy says)
    routing_key: str | None = None   # what a split hashes to pick the version (None: the tenant)
    hints: dict[str, bool] | None = None   # prefer_speed: the fast version while the class is slow

    @property
    def has_prompt(self) -> bool:
        return self.prompt is not None or self.prompt_token_ids is not None or self.messages is not None


class InferArgs(OpArgs, tag="infer"):
    """A handler model's inference: input i's bytes are payload frame i (handlers/tensors.py).
    context_inputs and context_append name a context's fields that stand for inputs."""
    inputs: tuple[TensorHeader, ...] = ()
    outputs: tuple[str, ...] | None = None   # the outputs to return (None: all the model has)
    model: str | None = None
    version: str | None = None
    routing_key: str | None = None
    hints: dict[str, bool] | None = None
    context: str | None = None
    context_inputs: dict[str, str] | None = None          # input name -> the context's field read as it
    context_append: dict[str, ContextAppend] | None = None   # field name -> the sent input appended to it
    cache: bool = True   # false: neither read nor fill the model's result cache

    @property
    def rows(self) -> int:
        """The request's rows: what its batch and its fair share count (the first input's first dim)."""
        return self.inputs[0].shape[0] if self.inputs else 1


class CancelArgs(OpArgs, tag="cancel"):
    target: int | str | None = None


class ContextOpenArgs(OpArgs, tag="context.open"):
    id: str | None = None
    create: bool = True


class ContextGetArgs(OpArgs, tag="context.get"):
    id: str | None = None
    since: int | None = None


class ContextUpdateArgs(OpArgs, tag="context.update"):
    id: str | None = None
    base: int | None = None
    changes: tuple[ANY_ENTRY, ...] = ()   # protocol/delta checks them against the payload frames


class ContextDropArgs(OpArgs, tag="context.drop"):
    id: str | None = None


class ContextListArgs(OpArgs, tag="context.list"):
    pass


ANY_ARGS = Union[PingArgs, StatusArgs, GenerateArgs, InferArgs, CancelArgs, ContextOpenArgs, ContextGetArgs,
                 ContextUpdateArgs, ContextDropArgs, ContextListArgs]
BY_OP: dict[str, type[OpArgs]] = {t.__struct_config__.tag: t for t in ANY_ARGS.__args__}
