"""An error is one value (protocol/error.py's ErrorReply) from the process that refuses to the
client and the HTTP listener: wire.error_reply alone turns it into the flat reply header of
docs/PROTOCOL.md section 5, and clients read it back with ErrorReply.read."""
import ast
from pathlib import Path

import msgpack
import pytest

import mcpd
from mcpd.client.replies import result_of
from mcpd.http.errors import STATUS_OF, HttpError
from mcpd.protocol import codes, wire
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.error import ErrorReply

PACKAGE = Path(mcpd.__file__).parent


def code_strings(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of the code, docstrings left out."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    return [node for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings]


def trees() -> dict[str, ast.AST]:
    return {str(path.relative_to(PACKAGE)): ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def test_only_the_wire_builds_an_error_reply_map():
    """A map with "kind": "error" is an error reply built by hand; the wire module is its one encoder."""
    building = [name for name, tree in trees().items() for node in ast.walk(tree) if isinstance(node, ast.Dict)
                and any(isinstance(k, ast.Constant) and k.value == "kind" and isinstance(v, ast.Constant)
                        and v.value == "error" for k, v in zip(node.keys, node.values))]
    assert building == ["protocol/wire.py"]


def test_the_error_fields_are_named_as_map_keys_only_by_the_wire():
    """Reading "retry_after_ms" (or writing it) out of a reply map by hand is what ErrorReply.read replaces."""
    naming = sorted({name for name, tree in trees().items() for node in code_strings(tree)
                     if node.value == "retry_after_ms"})
    assert naming == ["protocol/wire.py"]


def test_every_error_reply_is_encoded_from_the_value():
    """wire.error_reply takes (request id, ErrorReply): a call with loose code and message fields is gone."""
    calls = [(name, node.lineno, len(node.args)) for name, tree in trees().items() for node in ast.walk(tree)
             if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "error_reply"]
    assert calls and [c for c in calls if c[2] != 2] == []


@pytest.mark.parametrize("error, header", [
    (ErrorReply(codes.OVERLOADED, "queue full", 250),
     {"v": 1, "id": 7, "kind": "error", "code": "OVERLOADED", "message": "queue full", "retry_after_ms": 250}),
    (ErrorReply(codes.NOT_FOUND, "no such context"),
     {"v": 1, "id": 7, "kind": "error", "code": "NOT_FOUND", "message": "no such context"}),
])
def test_the_value_travels_as_the_documented_flat_header_and_reads_back_whole(error, header):
    raw = wire.error_reply(7, error)
    assert msgpack.unpackb(raw) == header
    assert ErrorReply.read(wire.decode_reply(raw)) == error
    with pytest.raises(MCPDError) as raised:
        result_of(wire.decode_reply(raw))
    assert (raised.value.code, raised.value.message, raised.value.retry_after_ms) == \
        (error.code, error.message, error.retry_after_ms)


def test_an_error_reply_that_does_not_decode_is_internal_naming_the_field():
    read = ErrorReply.read({"v": 1, "id": 7, "kind": "error", "code": 5, "message": "x"})
    assert read.code == codes.INTERNAL and "$.code" in read.message


def test_an_exception_and_a_bug_become_values():
    assert ErrorReply.of(MCPDError(codes.RATE_LIMITED, "slow down", 40)) == ErrorReply(codes.RATE_LIMITED, "slow down", 40)
    assert ErrorReply.internal(KeyError("k")) == ErrorReply(codes.INTERNAL, "KeyError: 'k'")


def test_every_code_has_its_http_status_in_one_table_and_keeps_its_retry_hint():
    assert sorted(STATUS_OF) == sorted(codes.ALL)
    refused = HttpError.of(ErrorReply(codes.OVERLOADED, "queue full", 1500))
    assert refused.status == 429 and refused.headers() == {"Retry-After": "2"}
    assert refused.body() == {"error": {"message": "queue full", "type": "rate_limit_error", "param": None,
                                        "code": codes.OVERLOADED}}
