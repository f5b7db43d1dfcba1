"""The control-op table (mcpd/protocol/control_ops.py) against what follows it: docs/PROTOCOL.md
section 9, the handlers in the supervisor and the scheduler, mcpctl, and its argument checks."""
import ast
import re
from pathlib import Path

import pytest

import mcpd
from mcpd.daemon.scheduler import admin as scheduler_admin
from mcpd.daemon.supervisor.admin import Admin
from mcpd.protocol import codes, control_ops
from mcpd.protocol.codes import MCPDError
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


@pytest.mark.parametrize("name", sorted(control_ops.OPS))
def test_each_op_is_documented_with_its_args_access_and_place(name):
    op, row = control_ops.OPS[name], documented_ops()[name]
    documented = dict(ARG.findall(row["args"]))
    assert sorted(documented) == sorted(a.name for a in op.args), row["args"]
    assert row["args"] == "none" or op.args
    for arg in op.args:
        words = documented[arg.name]
        assert words.startswith(arg.kind.__name__), (arg.name, words)
        assert ("required" in words) == arg.required, (arg.name, words)
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
    ("contexts.show", {"id": "a"}, {"owner": "default", "id": "a"}),
    ("contexts.list", {}, {"owner": None, "limit": control_ops.LIST_LIMIT}),
    ("contexts.list", {"owner": None, "limit": 5}, {"owner": None, "limit": 5}),
    ("reload", {"timeout_s": 2}, {"timeout_s": 2.0}),
    ("reload", {}, {"timeout_s": None}),
    ("ping", {}, {}),
])
def test_args_get_their_defaults(op, args, expected):
    assert control_ops.find(op).checked_args(args) == expected


@pytest.mark.parametrize("op, args, words", [
    ("ping", {"verbose": True}, "takes no argument 'verbose'"),
    ("workers.restart", {}, "'index' is required"),
    ("workers.restart", {"index": True}, "must be int, not bool"),
    ("workers.restart", {"index": "0"}, "must be int, not str"),
    ("workers.restart", {"index": -1}, "outside"),
    ("contexts.show", {"id": ""}, "length 0 is outside"),
    ("contexts.show", {"id": 7}, "must be str"),
    ("contexts.list", {"limit": 0}, "outside"),
    ("reload", {"timeout_s": 1e9}, "outside"),
    ("reload", {"timeout_s": float("nan")}, "must be a finite number"),
    ("models.shadow", {"model": "m", "version": "b", "fraction": float("nan")}, "must be a finite number"),
    ("keys.allow", {"name": "n"}, "'public_key' is required"),
])
def test_bad_args_are_bad_requests(op, args, words):
    with pytest.raises(MCPDError) as raised:
        control_ops.find(op).checked_args(args)
    assert raised.value.code == codes.BAD_REQUEST and words in raised.value.message
