"""The operations of protocol v1 and the checks of each one's "args".

The front-end validates args here, once, before any other process sees the request, and turns
them into the op's typed value (args.py, where the defaults are); the scheduler and the workers
read that value and trust its types and ranges. Each op lists its arguments as (accepted types,
check, conversion to the typed field); a generate's sampling arguments are sampling.py's struct,
decoded with the bounds declared there. Every integer has both bounds (sampling.py says why).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mcpd.protocol import args as typed
from mcpd.protocol import change_entry, codes, infer_args, sampling
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.limits import LimitsConfig
from mcpd.protocol.nesting import MAX_DEPTH, nests_within
from mcpd.protocol.sampling import INT64_MAX, MAX_TOKEN_ID

MAX_MESSAGES = 1024
MAX_CONTEXT_ID_CHARS = 128
MAX_CHANGES = 1024
MAX_MODEL_NAME_CHARS = 64     # as a model's or version's name in [models] (config/models.py)
MAX_ROUTING_KEY_CHARS = 256


@dataclass(frozen=True)
class Arg:
    types: tuple[type, ...]
    check: Callable[[Any, LimitsConfig], str | None] | None = None   # returns a problem or None
    convert: Callable[[Any], Any] | None = None                      # to the typed field's type


def _nonneg(v, _):
    return None if 0 <= v <= INT64_MAX else f"must be between 0 and {INT64_MAX}"


def _token_ids(v, limits):
    if len(v) > limits.max_prompt_tokens:
        return f"has {len(v)} tokens; the limit is {limits.max_prompt_tokens}"
    if not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in v):
        return "must be a list of non-negative integers"
    return None


def _messages(v, _):
    if not 0 < len(v) <= MAX_MESSAGES:
        return f"must hold 1..{MAX_MESSAGES} messages"
    for m in v:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return 'each message must be a map with string "role" and "content"'
        if not nests_within(m):
            return f"may nest at most {MAX_DEPTH} deep (a message's map counted)"
    return None


def _context_id(v, _):
    return None if 0 < len(v) <= MAX_CONTEXT_ID_CHARS else f"must be 1..{MAX_CONTEXT_ID_CHARS} characters"


def _request_id(v, _):
    return None if (type(v) is int and v >= 0) or (isinstance(v, str) and 0 < len(v) <= 64) else \
        "must be a request id (integer >= 0 or string of 1..64 characters)"


def _model_name(v, _):
    return None if 0 < len(v) <= MAX_MODEL_NAME_CHARS else f"must be 1..{MAX_MODEL_NAME_CHARS} characters"


def _routing_key(v, _):
    return None if 0 < len(v) <= MAX_ROUTING_KEY_CHARS else f"must be 1..{MAX_ROUTING_KEY_CHARS} characters"


HINTS = ("prefer_speed", "fit_max_tokens")


def _hints(v, _):
    if not all(name in HINTS and type(value) is bool for name, value in v.items()):
        return f"may hold only {', '.join(HINTS)}, each true or false"
    return None


GENERATE_ARGS = {
    "prompt": Arg((str,)),
    "prompt_token_ids": Arg((list,), _token_ids, tuple),
    "messages": Arg((list,), _messages, tuple),
    "stream": Arg((bool,)),
    "context": Arg((str,), _context_id),
    "base": Arg((int,), _nonneg),
    "model": Arg((str,), _model_name),
    "version": Arg((str,), _model_name),
    "routing_key": Arg((str,), _routing_key),
    "hints": Arg((dict,), _hints),
}
PROMPT_KINDS = ("prompt", "prompt_token_ids", "messages")
INFER_ARGS = {
    "inputs": Arg((list,), infer_args.inputs, infer_args.to_headers),
    "outputs": Arg((list,), infer_args.outputs, tuple),
    "model": Arg((str,), _model_name),
    "version": Arg((str,), _model_name),
    "routing_key": Arg((str,), _routing_key),
    "hints": Arg((dict,), _hints),
    "context": Arg((str,), _context_id),
    "context_inputs": Arg((dict,), infer_args.context_inputs),
    "context_append": Arg((dict,), infer_args.context_append, infer_args.to_appends),
    "cache": Arg((bool,)),
}


def _changes(v, _):
    return None if len(v) <= MAX_CHANGES else f"at most {MAX_CHANGES} changes per update"


CONTEXT_ID = Arg((str,), _context_id)

OPS: dict[str, dict[str, Arg]] = {
    "ping": {},
    "status": {},
    "generate": GENERATE_ARGS,
    "infer": INFER_ARGS,
    "cancel": {"target": Arg((int, str), _request_id)},
    "context.open": {"id": CONTEXT_ID, "create": Arg((bool,))},
    "context.get": {"id": CONTEXT_ID, "since": Arg((int,), _nonneg)},
    "context.update": {"id": CONTEXT_ID, "base": Arg((int,), _nonneg),
                       "changes": Arg((list,), _changes, change_entry.decode)},
    "context.drop": {"id": CONTEXT_ID},
    "context.list": {},
}
# A generate's sampling arguments arrive beside the others and become one field (sampling.py).
ACCEPTED = {op: frozenset(schema) | (frozenset(sampling.FIELDS) if op == "generate" else frozenset())
            for op, schema in OPS.items()}
# The args of the ops that take none, built once: they are frozen, and ping and status come often.
NO_ARGS = {op: typed.BY_OP[op]() for op, schema in OPS.items() if not schema}
assert all(set(OPS[op]) | ({"sampling"} if op == "generate" else set()) == set(kind.__struct_fields__)
           for op, kind in typed.BY_OP.items()), "ops.py and args.py disagree"


def validate_args(op: str, args: dict, limits: LimitsConfig) -> typed.OpArgs:
    """The op's typed args (defaults filled in), or raise MCPDError naming the bad argument."""
    schema = OPS.get(op)
    if schema is None:
        raise MCPDError(codes.UNKNOWN_OP, f"unknown op {op!r}; known ops: {', '.join(OPS)}")
    if not args and op in NO_ARGS:
        return NO_ARGS[op]
    unknown = args.keys() - ACCEPTED[op]   # holds any name that is not a string, too
    if unknown:
        if not all(isinstance(name, str) for name in unknown):
            raise MCPDError(codes.BAD_REQUEST, f"{op}: argument names must be strings")
        raise MCPDError(codes.BAD_REQUEST, f"{op}: unknown argument(s) {sorted(unknown)}")
    given = {}
    for name, arg in schema.items():
        value = args.get(name)
        if value is None:   # nil and absent both mean the default
            continue
        if isinstance(value, bool) and bool not in arg.types or not isinstance(value, arg.types):
            raise MCPDError(codes.BAD_REQUEST, f"{op}: argument {name!r} has the wrong type "
                                               f"({type(value).__name__})")
        problem = arg.check(value, limits) if arg.check else None
        if problem:
            raise MCPDError(codes.BAD_REQUEST, f"{op}: argument {name!r} {problem}")
        given[name] = arg.convert(value) if arg.convert else value
    if op == "generate":
        given["sampling"] = sampling.decode(op, args, limits)
    checked = typed.BY_OP[op](**given)
    _check_required(checked)
    return checked


_REQUIRED = {"cancel": ("target",), "context.update": ("id", "base")}   # else "id" where the op takes one


def _check_required(args: typed.OpArgs) -> None:
    if isinstance(args, typed.GenerateArgs):
        return _check_generate(args)
    if isinstance(args, typed.InferArgs):
        return infer_args.check(args)
    required = _REQUIRED.get(args.op, ("id",) if "id" in OPS[args.op] else ())
    missing = [name for name in required if getattr(args, name) is None]
    if missing:
        raise MCPDError(codes.BAD_REQUEST, f"{args.op}: argument(s) {missing} required")


def _check_generate(args: typed.GenerateArgs) -> None:
    prompts = sum(getattr(args, k) is not None for k in PROMPT_KINDS)
    if args.context is None and prompts != 1:
        raise MCPDError(codes.BAD_REQUEST, "generate: give exactly one of prompt, prompt_token_ids, messages")
    if args.context is not None and prompts > 1:
        raise MCPDError(codes.BAD_REQUEST, "generate on a context: give at most one of prompt, "
                                           "prompt_token_ids, messages (none continues the context)")
    if args.base is not None and args.context is None:
        raise MCPDError(codes.BAD_REQUEST, "generate: 'base' only goes with 'context'")
