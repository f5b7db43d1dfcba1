"""The checks of an infer's arguments (ops.py's table names them): its inputs' headers (their
frames are checked against them by the worker, tensors.decode), the outputs it wants, and the
context fields that stand for inputs. A bad datatype or shape is BAD_INPUT naming the input; a
map of the wrong form is BAD_REQUEST, as for every op."""
from __future__ import annotations

from mcpd.handlers.tensor_header import TensorHeader, check_header, element_count
from mcpd.protocol import codes
from mcpd.protocol.args import ContextAppend, InferArgs
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.limits import LimitsConfig

MAX_NAME_CHARS = 64       # an input's, an output's or a context field's name
MAX_OUTPUTS = 64
MAX_WINDOW = 1 << 24      # rows a context_append keeps


def _name(value) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS


def inputs(value: list, limits: LimitsConfig) -> str | None:
    """Raises BAD_INPUT for a datatype or shape no tensor has; a problem string for the rest."""
    if len(value) > limits.max_frames - 1:   # each sent input is a frame beside the header
        return f"holds {len(value)} inputs; at most {limits.max_frames - 1} (limits.max_frames - 1)"
    names = set()
    for item in value:
        if not (isinstance(item, dict) and item.keys() == {"name", "datatype", "shape"}):
            return 'each input must be a map of exactly "name", "datatype" and "shape"'
        if not _name(item["name"]) or item["name"] in names:
            return f"names must be unique strings of 1..{MAX_NAME_CHARS} characters"
        if not isinstance(item["datatype"], str) or not isinstance(item["shape"], list):
            return f'input {item["name"]!r}: "datatype" is a string and "shape" a list'
        names.add(item["name"])
        header = TensorHeader(item["name"], item["datatype"], tuple(item["shape"]))
        check_header(header)
        if element_count(header.shape) > limits.max_tensor_elements:
            raise MCPDError(codes.BAD_INPUT, f"input {header.name!r}: shape {item['shape']} holds more than "
                                             f"{limits.max_tensor_elements} elements (limits.max_tensor_elements)")
    return None


def to_headers(value: list) -> tuple[TensorHeader, ...]:
    return tuple(TensorHeader(item["name"], item["datatype"], tuple(item["shape"])) for item in value)


def outputs(value: list, _) -> str | None:
    if not 0 < len(value) <= MAX_OUTPUTS or not all(_name(v) for v in value) or len(set(value)) != len(value):
        return f"must hold 1..{MAX_OUTPUTS} unique names of 1..{MAX_NAME_CHARS} characters"
    return None


def context_inputs(value: dict, _) -> str | None:
    if not 0 < len(value) <= MAX_OUTPUTS or not all(_name(k) and _name(v) for k, v in value.items()):
        return f"maps 1..{MAX_OUTPUTS} input names to field names, each 1..{MAX_NAME_CHARS} characters"
    return None


def context_append(value: dict, _) -> str | None:
    for field, append in value.items():
        if not (_name(field) and isinstance(append, dict) and append.keys() == {"input", "window"}
                and _name(append["input"]) and type(append["window"]) is int and 0 < append["window"] <= MAX_WINDOW):
            return (f'maps field names to {{"input": name, "window": 1..{MAX_WINDOW}}}')
    return None if 0 < len(value) <= MAX_OUTPUTS else f"holds 1..{MAX_OUTPUTS} fields"


def to_appends(value: dict) -> dict[str, ContextAppend]:
    return {field: ContextAppend(append["input"], append["window"]) for field, append in value.items()}


def check(args: InferArgs) -> None:
    """What spans arguments: at least one input, context fields only with a context, and no
    name both sent and read from the context."""
    sent = {header.name for header in args.inputs}
    if not sent and not args.context_inputs:
        raise MCPDError(codes.BAD_REQUEST, "infer: give at least one input (inputs, or context_inputs)")
    if (args.context_inputs or args.context_append) and args.context is None:
        raise MCPDError(codes.BAD_REQUEST, "infer: context_inputs and context_append need 'context'")
    both = sent & set(args.context_inputs or ())
    if both:
        raise MCPDError(codes.BAD_INPUT, f"infer: input(s) {sorted(both)} are both sent and read from the context")
    unsent = {a.input for a in (args.context_append or {}).values()} - sent
    if unsent:
        raise MCPDError(codes.BAD_INPUT, f"infer: context_append names input(s) {sorted(unsent)} that are not sent")


def check_frames(args: InferArgs, frames: int) -> None:
    """The front-end's check that each sent input has its frame, and no frame is left over."""
    if frames != len(args.inputs):
        raise MCPDError(codes.BAD_INPUT, f"infer: {len(args.inputs)} input(s) sent with {frames} payload frame(s); "
                                         "each input's bytes are one frame, in the inputs' order")
