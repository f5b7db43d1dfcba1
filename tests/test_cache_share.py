"""Room for every tenant in the host cache, and bounded contexts, through the real daemon (issue 13).

One small cache (2 MiB: ~120 pages of 16 KiB, 1024 entry slots) stands in for the default
256 MiB one, so the same proportions are reached in seconds:
- a tenant's scalar commits take a small block each, not a page (before: 121 contexts filled it);
- a tenant that fills its share (cache.max_owner_fraction) is refused TOO_LARGE, and another
  tenant's open, update and chat turn still go through;
- the daemon reaches contexts.max_contexts, and refuses the next context with that limit's name;
- contexts.max_fields bounds the fields of one context.
"""
import pytest

from mcpd.client import Client
from mcpd.protocol import codes
from mcpd.protocol import delta as codec
from mcpd.protocol.codes import MCPDError

MAX_CONTEXTS = 1000
PER_OWNER = 300
MAX_FIELDS = 64


@pytest.fixture(scope="module")
def daemon(module_daemon):
    return module_daemon(cache={"bytes": 2 << 20},
                         contexts={"max_contexts": MAX_CONTEXTS, "max_per_owner": PER_OWNER, "max_fields": MAX_FIELDS})


def update(client: Client, context_id: str, base: int, **fields) -> int:
    entries, frames = codec.to_wire([codec.diff(name, None, value) for name, value in fields.items()])
    result, _ = client.call_with_payload("context.update", {"id": context_id, "base": base, "changes": entries},
                                         frames)
    return result["version"]


def open_and_commit(client: Client, context_id: str, **fields) -> None:
    client.call("context.open", {"id": context_id})
    update(client, context_id, 0, **fields)


def refusal(call) -> MCPDError:
    with pytest.raises(MCPDError) as raised:
        call()
    return raised.value


def contexts_of(daemon) -> dict:
    return daemon.status()["contexts"]


def test_fields_per_context_are_bounded(daemon):
    with Client(daemon.endpoint, tenant="wide") as client:
        client.call("context.open", {"id": "wide"})
        update(client, "wide", 0, **{f"f{i}": i for i in range(MAX_FIELDS)})
        refused = refusal(lambda: update(client, "wide", 1, extra=1))
        assert refused.code == codes.TOO_LARGE and "contexts.max_fields" in refused.message
        assert update(client, "wide", 1, f0=-1) == 2   # changing the fields it has goes on
        assert client.call("context.get", {"id": "wide", "since": 1})["version"] == 2


def test_a_tenant_filling_its_share_leaves_room_for_the_others(daemon):
    with Client(daemon.endpoint, tenant="scalars") as scalars:
        for i in range(PER_OWNER):   # before issue 13 each took a 16 KiB page: the 121st filled the cache
            open_and_commit(scalars, f"s{i}", n=i)
    daemon.wait_until(lambda: contexts_of(daemon)["cache_entries"] >= PER_OWNER, 30, "cache figures")
    small = contexts_of(daemon)
    assert small["cache_bytes"] < PER_OWNER * 1024   # a few hundred bytes each
    with Client(daemon.endpoint, tenant="hog") as hog:
        refused = None
        for i in range(PER_OWNER):
            try:
                open_and_commit(hog, f"h{i}", blob=bytes(2000))
            except MCPDError as e:
                refused = e
                break
        assert refused is not None and refused.code == codes.TOO_LARGE, refused
        assert "cache.max_owner_fraction" in refused.message
    with Client(daemon.endpoint, tenant="victim", timeout=120) as victim:
        chat = victim.context("chat")
        chat["notes"] = "still room"
        assert chat.sync() == 1
        result = chat.generate("Hello there", max_tokens=4, temperature=0)
        assert result.context.version == 2
    daemon.wait_until(lambda: contexts_of(daemon)["cache_largest_tenant_bytes"] > small["cache_bytes"], 30, "figures")
    figures = contexts_of(daemon)
    assert figures["cache_largest_tenant_bytes"] <= figures["cache_tenant_share_bytes"]


def test_the_daemon_reaches_its_contexts_maximum(daemon):
    opened, tenant = contexts_of(daemon)["contexts"], 0
    refused = None
    fillers: dict[str, list[str]] = {}   # dropped at the end: the module's other tests need room
    try:
        while refused is None and opened <= MAX_CONTEXTS:
            with Client(daemon.endpoint, tenant=f"filler{tenant}") as client:
                for i in range(PER_OWNER):
                    try:
                        client.call("context.open", {"id": f"c{i}"})
                    except MCPDError as e:
                        refused = e
                        break
                    fillers.setdefault(f"filler{tenant}", []).append(f"c{i}")
                    opened += 1
            tenant += 1
        assert opened == MAX_CONTEXTS and refused.code == codes.TOO_LARGE
        assert "contexts.max_contexts" in refused.message, refused.message
        with Client(daemon.endpoint, tenant="filler0") as client:   # a drop makes room again
            assert client.call("context.drop", {"id": "c0"})["dropped"]
            fillers["filler0"].remove("c0")
            assert client.call("context.open", {"id": "again"})["created"]
            fillers["filler0"].append("again")
    finally:
        for owner, ids in fillers.items():
            with Client(daemon.endpoint, tenant=owner) as client:
                for context_id in ids:
                    client.call("context.drop", {"id": context_id})
