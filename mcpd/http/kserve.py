"""The Open Inference Protocol (KServe v2, what Triton, KServe and MLServer speak) as the `infer`
op: an OIP infer body into the op's args and payload frames, and the op's reply into an OIP
response (socket-free).

A body is JSON, or, with the binary extension, a JSON header of `Inference-Header-Content-Length`
bytes followed by the raw bytes of the inputs that say `"parameters": {"binary_data_size": n}`,
in input order. Raw bytes are the ZeroMQ frames' form (little-endian, C order, BYTES elements
length-prefixed), so they pass as they are. Outputs come back as JSON `data`, or as raw bytes
after the JSON header when asked (`binary_data` per output, `binary_data_output` for all).

numpy-free, as the front-end is (tests/test_import_direction.py): JSON data is packed with
struct. Checked here: types, each input's header as the daemon checks a ZeroMQ client's, and
every byte count against the body that arrived, so no shape allocates more than the body; the
model's signature is the daemon's check.
"""
from __future__ import annotations

import gc
import struct
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import msgspec

from mcpd.handlers.tensor_header import TensorHeader, check_header, element_count
from mcpd.http.errors import HttpError, bad_request
from mcpd.http.openai_request import parse_json
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.infer_args import MAX_NAME_CHARS

HEADER_LENGTH = "Inference-Header-Content-Length"
MAX_HEADER_LENGTH_DIGITS = 19
# struct's codes, packed little-endian; BYTES is length-prefixed instead (LENGTH).
FORMATS = {"BOOL": "?", "UINT8": "B", "INT8": "b", "INT16": "h", "INT32": "i", "INT64": "q",
           "FP16": "e", "FP32": "f", "FP64": "d"}
BYTES = "BYTES"
LENGTH = struct.Struct("<I")
# The JSON types `data` may hold per datatype (a bool is not a number here, as in the OpenAI routes).
JSON_TYPES = {"BOOL": {bool}, "FP16": {int, float}, "FP32": {int, float}, "FP64": {int, float}, BYTES: {str},
              **{name: {int} for name in ("UINT8", "INT8", "INT16", "INT32", "INT64")}}
DATA_KINDS = {"BOOL": "true or false", "FP16": "numbers", "FP32": "numbers", "FP64": "numbers", BYTES: "strings"}
# OIP request parameters that are mcpd's infer args (docs/PROTOCOL.md section 11).
ARG_PARAMETERS = {"routing_key": str, "context": str, "context_inputs": dict, "context_append": dict, "cache": bool}
encode_json = msgspec.json.encode


@dataclass(frozen=True)
class InferRequest:
    """One OIP infer request as the daemon takes it, and how its answer is to be written."""
    args: dict                          # the infer op's
    payload: list[bytes]                # frame i holds args["inputs"][i]'s bytes
    id: str | None = None               # the client's request id, echoed in the response
    binary_output: bool = False         # outputs not named in binary_of: raw bytes rather than JSON
    binary_of: dict[str, bool] = field(default_factory=dict)

    def wants_binary(self, name: str) -> bool:
        return self.binary_of.get(name, self.binary_output)


def infer_request(body: bytes, header_length: str | None, model: str, version: str | None) -> InferRequest:
    """The infer op for an OIP body; HttpError (400) naming what is wrong."""
    with _no_gc_passes():
        return _infer_request(body, header_length, model, version)


@contextmanager
def _no_gc_passes() -> Iterator[None]:
    """The cyclic GC held off while JSON data becomes lists and is flattened: its passes over the
    fresh lists (a body of nested data holds hundreds of thousands, none in a cycle) cost more
    than the decoding, on the front-end's loop."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _infer_request(body: bytes, header_length: str | None, model: str, version: str | None) -> InferRequest:
    head, binary = _split(body, header_length)
    request = parse_json(head, msgspec.json.decode)   # tensor data: msgspec parses numbers several times faster
    inputs = _typed(request.get("inputs"), list, "inputs")
    parameters = _typed(request.get("parameters"), dict, "parameters") or {}
    if not inputs and not (inputs == [] and parameters.get("context_inputs")):
        raise bad_request("'inputs' must be a non-empty array (empty only when parameters.context_inputs "
                          "stand for every input)", "inputs")
    headers, payload, at = [], [], 0
    for index, item in enumerate(inputs):
        header, frame, at = _input(_typed(item, dict, f"inputs[{index}]"), index, binary, at)
        headers.append(header)
        payload.append(frame)
    if at != len(binary):
        raise bad_request(f"{len(binary) - at} bytes of binary data after the inputs' binary_data_size",
                          "binary_data_size")
    args = {"model": model, "inputs": headers, **_arg_parameters(parameters)}
    if version is not None:
        args["version"] = version
    names, binary_of = _requested_outputs(request.get("outputs"))
    if names is not None:
        args["outputs"] = names
    request_id = request.get("id")
    return InferRequest(args, payload, None if request_id is None else _typed(request_id, str, "id"),
                        bool(_typed(parameters.get("binary_data_output"), bool, "parameters.binary_data_output")),
                        binary_of)


def infer_response(result: dict, frames: list[bytes], request: InferRequest) -> tuple[bytes, dict[str, str]]:
    """The OIP response body and headers for the infer op's ok reply (its result and frames)."""
    outputs, raw = [], []
    if len(result["outputs"]) != len(frames):
        raise HttpError(500, f"the daemon answered {len(result['outputs'])} outputs with {len(frames)} frames",
                        codes.INTERNAL)
    for output, frame in zip(result["outputs"], frames):
        described = {"name": output["name"], "datatype": output["datatype"], "shape": output["shape"]}
        data = None if request.wants_binary(output["name"]) else _json_data(output, frame)
        if data is None:   # asked for raw bytes, or BYTES that are not UTF-8 (JSON cannot carry them)
            described["parameters"] = {"binary_data_size": len(frame)}
            raw.append(frame)
        else:
            described["data"] = data
        outputs.append(described)
    parameters = {"cached": bool(result.get("cached"))}
    if "context_version" in result:
        parameters["context_version"] = result["context_version"]
    response = {"model_name": result["model"], "model_version": result["version"], "outputs": outputs,
                "parameters": parameters}
    if request.id is not None:
        response["id"] = request.id
    head = encode_json(response)
    if not raw:
        return head, {"Content-Type": "application/json"}
    return head + b"".join(raw), {HEADER_LENGTH: str(len(head)), "Content-Type": "application/octet-stream"}


def error_body(message: str, code: str) -> bytes:
    """OIP's error body, `{"error": message}`, with mcpd's stable code beside it."""
    return encode_json({"error": message, "code": code})


# -- the request's parts ---------------------------------------------------------------------------

def _split(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """The JSON header and the binary data after it."""
    if header_length is None:
        return body, memoryview(b"")
    text = header_length.strip()
    if not (0 < len(text) <= MAX_HEADER_LENGTH_DIGITS and text.isascii() and text.isdigit()):
        raise bad_request(f"header {HEADER_LENGTH} must be ASCII digits, not {text[:40]!r}", HEADER_LENGTH)
    length = int(text)
    if length > len(body):
        raise bad_request(f"{HEADER_LENGTH} is {length}; the body has {len(body)} bytes", HEADER_LENGTH)
    view = memoryview(body)
    return bytes(view[:length]), view[length:]


def _input(item: dict, index: int, binary: memoryview, at: int) -> tuple[dict, bytes, int]:
    """Input `index`'s header for the infer op, its frame, and where the next binary data starts."""
    header = _header(item, index)
    name, datatype, count = header.name, header.datatype, element_count(header.shape)
    parameters = _typed(item.get("parameters"), dict, f"inputs[{index}].parameters") or {}
    size = parameters.get("binary_data_size")
    data = item.get("data")
    if (size is None) == (data is None):
        raise _bad_input(name, "give either 'data' or parameters.binary_data_size (with binary data after the "
                               f"{HEADER_LENGTH} bytes of JSON), not both or neither")
    if size is None:
        frame = _packed(name, datatype, _typed(data, list, f"inputs[{index}].data"), count)
    else:
        if type(size) is not int or not 0 <= size <= len(binary) - at:
            raise _bad_input(name, f"binary_data_size {str(size)[:20]} runs past the body's "
                                   f"{len(binary)} bytes of binary data")
        frame = bytes(binary[at:at + size])
        _check_raw_size(header, count, size)
        at += size
    return header.describe(), frame, at


def _header(item: dict, index: int) -> TensorHeader:
    """The input's name, datatype and shape, checked as the daemon checks a ZeroMQ client's (so a
    shape's element count is a small number of bits before anything is counted)."""
    name = _typed(item.get("name"), str, f"inputs[{index}].name")
    if name is None or not 0 < len(name) <= MAX_NAME_CHARS:
        raise bad_request(f"'inputs[{index}].name' must be a string of 1..{MAX_NAME_CHARS} characters",
                          f"inputs[{index}].name")
    datatype = _typed(item.get("datatype"), str, f"inputs[{index}].datatype")
    shape = item.get("shape")
    header = TensorHeader(name, datatype, tuple(shape) if isinstance(shape, list) else ())
    try:
        check_header(header)
    except MCPDError as e:
        raise HttpError(400, e.message, e.code, "inputs") from None
    return header


def _check_raw_size(header: TensorHeader, count: int, size: int) -> None:
    shape = list(header.shape)
    if header.datatype == BYTES:
        if count * LENGTH.size > size:   # each element takes at least its length prefix
            raise _bad_input(header.name, f"shape {shape} of BYTES cannot fit in {size} bytes")
        return   # its elements' lengths are the worker's to read (handlers/tensors.py)
    expected = count * struct.calcsize(FORMATS[header.datatype])
    if expected != size:
        raise _bad_input(header.name, f"shape {shape} of {header.datatype} is {expected} bytes; "
                                      f"binary_data_size is {size}")


def _flat(data: list) -> list:
    """Nested OIP data in row-major order, flat (any depth: no recursion)."""
    flat, stack = [], [iter(data)]
    while stack:
        for x in stack[-1]:
            if type(x) is list:
                stack.append(iter(x))
                break
            flat.append(x)
        else:
            stack.pop()
    return flat


def _packed(name: str, datatype: str, values: list, count: int) -> bytes:
    """JSON `data`, flat or nested, as the raw bytes of its datatype."""
    kinds = set(map(type, values))   # one pass in C, not a generator step per element
    if list in kinds:
        values = _flat(values)
        kinds = set(map(type, values))
    if len(values) != count:
        raise _bad_input(name, f"'data' has {len(values)} elements; its shape has {count}")
    if not kinds <= JSON_TYPES[datatype]:
        raise _bad_input(name, f"{datatype} data must be {DATA_KINDS.get(datatype, 'integers')}")
    try:
        if datatype == BYTES:
            return b"".join(LENGTH.pack(len(b)) + b for b in (v.encode() for v in values))
        return struct.pack(f"<{count}{FORMATS[datatype]}", *values)
    except (struct.error, OverflowError) as e:   # out of the datatype's range
        raise _bad_input(name, f"a value does not fit {datatype}: {str(e)[:100]}") from None


def _requested_outputs(outputs) -> tuple[list[str] | None, dict[str, bool]]:
    """The outputs asked for (None: all), and {name: raw bytes wanted} for those that say."""
    if outputs is None:
        return None, {}
    names, binary_of = [], {}
    for index, item in enumerate(_typed(outputs, list, "outputs")):
        item = _typed(item, dict, f"outputs[{index}]")
        name = _typed(item.get("name"), str, f"outputs[{index}].name")
        parameters = _typed(item.get("parameters"), dict, f"outputs[{index}].parameters") or {}
        if parameters.get("classification"):
            raise bad_request("the classification extension is not supported: ask for the output itself",
                              f"outputs[{index}].parameters.classification")
        names.append(name)
        binary = _typed(parameters.get("binary_data"), bool, f"outputs[{index}].parameters.binary_data")
        if binary is not None:
            binary_of[name] = binary
    return names, binary_of


def _arg_parameters(parameters: dict) -> dict:
    """The request parameters that are infer args; other parameters (Triton's) are ignored, as OIP allows."""
    args = {name: _typed(parameters[name], kind, f"parameters.{name}")
            for name, kind in ARG_PARAMETERS.items() if parameters.get(name) is not None}
    prefer_speed = parameters.get("prefer_speed")
    if prefer_speed is not None:
        args["hints"] = {"prefer_speed": _typed(prefer_speed, bool, "parameters.prefer_speed")}
    return args


def _typed(value, kind: type, where: str):
    """value if it has the JSON type (a bool is no int); 400 naming where otherwise. None passes."""
    if value is None or (isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)):
        return value
    expected = {list: "an array", dict: "an object", str: "a string", bool: "a boolean"}[kind]
    raise bad_request(f"'{where}' must be {expected}", where)


def _bad_input(name: str, message: str) -> HttpError:
    return HttpError(400, f"input {name[:64]!r}: {message}", codes.BAD_INPUT, "inputs")


# -- the response's data -----------------------------------------------------------------------------

def _json_data(output: dict, frame: bytes) -> list | None:
    """An output's elements as JSON data, row-major and flat; None for BYTES that are not UTF-8."""
    count = 1
    for dim in output["shape"]:
        count *= dim
    if output["datatype"] == BYTES:
        return _utf8_elements(frame, count)
    try:
        return list(struct.unpack(f"<{count}{FORMATS[output['datatype']]}", frame))
    except (struct.error, KeyError):
        raise HttpError(500, f"the daemon's output {output['name']!r} does not match its shape and datatype",
                        codes.INTERNAL) from None


def _utf8_elements(frame: bytes, count: int) -> list[str] | None:
    items, at = [], 0
    try:
        for _ in range(count):
            (length,) = LENGTH.unpack_from(frame, at)
            at += LENGTH.size
            items.append(frame[at:at + length].decode())
            at += length
    except UnicodeDecodeError:
        return None
    except struct.error:
        raise HttpError(500, "the daemon's BYTES output is cut short", codes.INTERNAL) from None
    return items
