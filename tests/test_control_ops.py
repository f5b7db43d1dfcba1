"""The control-op table (mcpd/protocol/control_ops.py) against what follows it: docs/PROTOCOL.md
section 9, the handlers in the supervisor and the scheduler, mcpctl, and its argument checks."""
import ast
import re
from pathlib import Path

import msgspec
import pytest

import mcpd
from mcpd.daemon.scheduler import admin as scheduler_admin
from mcpd.daemon.supervisor.admin import Admin
from mcpd.protocol import codes, control_args, control_ops
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.control_args import ContextListing, ContextRef, NoArgs, ReloadTimeout, TrafficSplit
from mcpd.protocol.control_ops import Access, Place

ROOT = Path(mcpd.__file__).parent.parent
ROW = re.compile(r"^\| `(?P<op>[a-z.]+)` \| (?P<args>.*?) \| (?P<who>[a-z ]+) \| (?P<where>[a-z -]+) \| (?P<result>.+) \|$")
ARG = re.compile(r"`(\w+)` \(([^)]*)\)")


def documented_ops() -> dict[str, dict]:
    text = (ROOT / "docs/PROTOCOL.md").read_text()
    section = text[text.index("## 9. Control socket"):text.index("## 10.")]
    rows = [ROW.match(line) for line in section.splitlines() if line.startswith("| `")]
    assert all(rows), [line for line in section.splitlines() if line.startswith("| `") and not ROW.match(line)]
    return {row["op"]: row.groupdict() for row in rows}


def test_the_doc_lists_exactly_the_tables_ops():
    assert sorted(documented_ops()) == sorted(control_ops.OPS)


KIND_NAMES = {msgspec.inspect.StrType: "str", msgspec.inspect.IntType: "int", msgspec.inspect.FloatType: "float",
              msgspec.inspect.DictType: "dict"}


def declared_args(op: control_ops.ControlOp) -> dict[str, tuple[str, bool, msgspec.inspect.Type]]:
    """Each argument of the op's struct: its msgpack type's name, whether it is required, and its
    type as msgspec sees it (without the nil a default allows)."""
    declared = {}
    for field in msgspec.inspect.type_info(op.arg_struct).fields:
        kind = field.type
        if isinstance(kind, msgspec.inspect.UnionType):
            kind = next(t for t in kind.types if not isinstance(t, msgspec.inspect.NoneType))
        declared[field.name] = (KIND_NAMES[type(kind)], field.required, kind)
    return declared


@pytest.mark.parametrize("name", sorted(control_ops.OPS))
def test_each_op_is_documented_with_its_args_access_and_place(name):
    op, row = control_ops.OPS[name], documented_ops()[name]
    documented = dict(ARG.findall(row["args"]))
    declared = declared_args(op)
    assert sorted(documented) == sorted(declared), row["args"]
    assert row["args"] == "none" or declared
    for arg, (kind, required, _) in declared.items():
        words = documented[arg]
        assert words.startswith(kind), (arg, words)
        assert ("required" in words) == required, (arg, words)
    assert row["who"] == op.access.value and row["where"] == op.runs_in.value


@pytest.mark.parametrize("name", sorted(control_ops.OPS))
def test_each_op_has_its_handler_where_it_runs(name):
    op = control_ops.OPS[name]
    home = scheduler_admin if op.runs_in is Place.SCHEDULER else Admin
    assert callable(getattr(home, op.handler, None)), (name, op.handler)


def test_mcpctl_sends_every_op():
    """Each op of the table is reachable from a command (mcpctl names ops as string literals)."""
    literals = {node.value for path in (ROOT / "mcpd/cli").glob("*.py")
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert sorted(set(control_ops.OPS) - literals) == []


def test_only_ping_and_status_are_open():
    assert sorted(n for n, op in control_ops.OPS.items() if op.access is Access.ANYONE) == ["ping", "status"]
    assert not control_ops.open_to_anyone("no.such.op")   # a new op is privileged until said otherwise


def test_unknown_op_names_the_known_ones():
    with pytest.raises(MCPDError) as raised:
        control_ops.find("contexts.nuke")
    assert raised.value.code == codes.UNKNOWN_OP and "contexts.drop" in raised.value.message


@pytest.mark.parametrize("op, args, expected", [
    ("contexts.show", {"id": "a"}, ContextRef(owner="default", id="a")),
    ("contexts.list", {}, ContextListing(owner=None, limit=control_args.LIST_LIMIT)),
    ("contexts.list", {"owner": None, "limit": 5}, ContextListing(owner=None, limit=5)),
    ("reload", {"timeout_s": 2}, ReloadTimeout(timeout_s=2.0)),
    ("reload", {}, ReloadTimeout(timeout_s=None)),
    ("models.split", {"model": "m", "weights": {"a": 1, "b": 0.5}}, TrafficSplit("m", {"a": 1.0, "b": 0.5})),
    ("ping", {}, NoArgs()),
])
def test_args_decode_into_the_ops_struct_with_its_defaults(op, args, expected):
    decoded = control_ops.find(op).decode_args(args)
    assert decoded == expected and type(decoded) is type(expected)
    assert all(type(w) is float for w in getattr(decoded, "weights", {}).values())


@pytest.mark.parametrize("op, args, words", [
    ("ping", {"verbose": True}, "unknown field `verbose`"),
    ("workers.restart", {}, "missing required field `index`"),
    ("workers.restart", {"index": None}, "missing required field `index`"),
    ("workers.restart", {"index": True}, "got `bool` - at `$.index`"),
    ("workers.restart", {"index": "0"}, "got `str` - at `$.index`"),
    ("workers.restart", {"index": -1}, ">= 0 - at `$.index`"),
    ("contexts.show", {"id": ""}, "length >= 1 - at `$.id`"),
    ("contexts.show", {"id": 7}, "got `int` - at `$.id`"),
    ("contexts.list", {"limit": 0}, "at `$.limit`"),
    ("reload", {"timeout_s": 1e9}, "at `$.timeout_s`"),
    ("reload", {"timeout_s": float("nan")}, "at `$.timeout_s`"),
    ("models.shadow", {"model": "m", "version": "b", "fraction": float("nan")}, "at `$.fraction`"),
    ("models.split", {"model": "m", "weights": {"a": float("inf")}}, "at `$.weights[...]`"),
    ("models.split", {"model": "m", "weights": {"a": True}}, "at `$.weights[...]`"),
    ("models.split", {"model": "m", "weights": {7: 1.0}}, "in `$.weights`"),
    ("models.split", {"model": "m", "weights": [1.0]}, "at `$.weights`"),
    ("keys.allow", {"name": "n"}, "missing required field `public_key`"),
])
def test_bad_args_are_bad_requests_naming_the_argument(op, args, words):
    with pytest.raises(MCPDError) as raised:
        control_ops.find(op).decode_args(args)
    assert raised.value.code == codes.BAD_REQUEST and words in raised.value.message, raised.value.message
    assert repr(op) in raised.value.message


def hostile_values(kind: msgspec.inspect.Type) -> list:
    """Values of the wrong type, and values just outside the declared bounds."""
    wrong = [[1], b"x", True] if not isinstance(kind, msgspec.inspect.DictType) else [[1], "x", {"v": "1"}]
    bounds = {"ge": -1, "gt": 0, "le": 1, "lt": 0, "min_length": -1, "max_length": 1}
    for name, step in bounds.items():
        limit = getattr(kind, name, None)
        if limit is not None:
            wrong.append(limit + step if isinstance(kind, (msgspec.inspect.IntType, msgspec.inspect.FloatType))
                         else "x" * (limit + step))
    return wrong


HOSTILE = [(name, arg, value) for name, op in sorted(control_ops.OPS.items())
           for arg, (_, _, kind) in sorted(declared_args(op).items()) for value in hostile_values(kind)]


@pytest.mark.parametrize("name, arg, value", HOSTILE)
def test_every_ops_every_arg_refuses_hostile_values_naming_it(name, arg, value):
    """A wrong type or a value past a declared bound, whatever the other args: BAD_REQUEST at `$.arg`."""
    with pytest.raises(MCPDError) as raised:
        control_ops.find(name).decode_args({arg: value})
    assert raised.value.code == codes.BAD_REQUEST and f"`$.{arg}" in raised.value.message, raised.value.message


@pytest.mark.parametrize("name", sorted(control_ops.OPS))
def test_every_op_refuses_an_argument_it_does_not_declare(name):
    with pytest.raises(MCPDError) as raised:
        control_ops.find(name).decode_args({"zz_not_an_arg": 1})
    assert raised.value.code == codes.BAD_REQUEST and "unknown field `zz_not_an_arg`" in raised.value.message
