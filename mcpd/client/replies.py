"""What both clients share: building generate arguments and turning reply headers into results."""
from __future__ import annotations

import msgspec

from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.error import ErrorReply
from mcpd.protocol.results import GenerateChunk, GenerateResult

DEFAULT_ENDPOINT = "tcp://127.0.0.1:7070"


def generate_args(prompt, messages, prompt_token_ids, stream: bool, params: dict) -> dict:
    args = {k: v for k, v in params.items() if v is not None}
    for name, value in (("prompt", prompt), ("messages", messages), ("prompt_token_ids", prompt_token_ids)):
        if value is not None:
            args[name] = value
    if "stop" in args and isinstance(args["stop"], str):
        args["stop"] = [args["stop"]]
    args["stream"] = stream
    return args


def request_header(priority: str | None, timeout_ms: int | None) -> dict:
    """The optional header fields of a generate: its priority class and its deadline."""
    return {k: v for k, v in (("priority", priority), ("timeout_ms", timeout_ms)) if v is not None}


def result_of(reply: dict) -> dict:
    """The "result" map of a final ok reply; an error reply raises MCPDError with its code."""
    kind = reply.get("kind")
    if kind == "error":
        raise ErrorReply.read(reply).exception()
    if kind != "ok":
        raise MCPDError(codes.INTERNAL, f"unexpected reply kind {kind!r}")
    return reply.get("result", {})


def generate_result(result: dict) -> GenerateResult:
    return _typed(result, GenerateResult)


def chunk_of(reply: dict) -> GenerateChunk:
    return _typed(reply.get("data"), GenerateChunk)


def _typed(value, kind: type[msgspec.Struct]):
    """The reply's map as the struct the daemon built it from; a daemon that sent another shape fails INTERNAL."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as e:
        raise MCPDError(codes.INTERNAL, f"the daemon's {kind.__name__} does not decode: {e}") from None


def timeout_error(request_id, seconds: float) -> MCPDError:
    return MCPDError(codes.TIMEOUT, f"no reply to request {request_id!r} within {seconds:g}s")


def owner_of(reply: dict, waiting) -> object | None:
    """The request in `waiting` (ids, a set or a dict) that reply answers, or None. A reply the
    daemon could not tie to a request carries no id (TOO_LARGE, an undecodable header:
    PROTOCOL.md §2); with one request in flight it can only be that one's, which then fails at
    once with the reason instead of timing out."""
    request_id = reply.get("id")
    if request_id is None and len(waiting) == 1:
        return next(iter(waiting))
    return request_id if request_id in waiting else None
