"""The front-end's core forwarding in-process: a request for a context another node owns goes to
that node's link (not the scheduler) with the hop marker and its tenant, and the node's replies
come back to the client under its own request id; the node lost, the client's cancel, no
connection to the node and a forwarded request each end as docs/CLUSTER.md says; a plain request
on a node over its load threshold goes to the least-loaded node under it. The real links and
daemons: test_forwarding.py."""
import logging

import msgpack
import pytest

from mcpd.cluster.node_report import NodeReport
from mcpd.cluster.offload import queued_by_node
from mcpd.config import from_dict
from mcpd.daemon import messages
from mcpd.daemon.frontend.core import FrontEndCore
from mcpd.protocol import codes, wire
from mcpd.testing import contexts_owned_by
from fakes import Clock, Ports

FIRST_RID = 1000
CLIENT = b"\x00client"
NODES = {"here": messages.OwnerNode("tcp://127.0.0.1:7001", 1.0), "there": messages.OwnerNode("tcp://127.0.0.1:7002", 1.0)}
THERE, HERE = (contexts_owned_by(owner, list(NODES), "acme", 1)[0] for owner in ("there", "here"))


class Links:
    """The links to other nodes: what was sent to each; `up` the nodes a connection is complete to."""

    def __init__(self):
        self.sent: list[tuple[str, dict, list[bytes]]] = []
        self.up = {"there"}

    def sync(self, nodes) -> None:
        pass

    def send(self, node_id, frames) -> bool:
        if node_id not in self.up:
            return False
        self.sent.append((node_id, msgpack.unpackb(frames[0]), frames[1:]))
        return True

    def connected(self) -> list[str]:
        return sorted(self.up)


@pytest.fixture
def core():
    ports = Ports()
    ports.peers = Links()
    made = FrontEndCore(from_dict({"cluster": {"redis": "redis://127.0.0.1:1/0", "node_id": "here"}}),
                        logging.getLogger("test"), ports, Clock(), first_rid=FIRST_RID)
    made.on_scheduler(messages.Members(NODES, {}), [])
    return made


THREE = {**NODES, "third": messages.OwnerNode("tcp://127.0.0.1:7003", 1.0)}


def node_among_three(offload_queued: int) -> FrontEndCore:
    """A core of node "here", connected to the two others."""
    ports = Ports()
    ports.peers = Links()
    ports.peers.up = {"there", "third"}
    config = {"cluster": {"redis": "redis://127.0.0.1:1/0", "node_id": "here", "offload_queued": offload_queued}}
    return FrontEndCore(from_dict(config), logging.getLogger("test"), ports, Clock(), first_rid=FIRST_RID)


@pytest.fixture
def loaded():
    """Plain requests offloaded past 4 queued."""
    return node_among_three(4)


def generate_on(core, context_id: str, request_id=7, **header) -> None:
    frames = [wire.encode_request("generate", request_id, {"context": context_id, "prompt": "hi", "max_tokens": 2},
                                  tenant="acme", **header)]
    core.on_client(CLIENT, frames, [len(f) for f in frames], None)


def peer_reply(core, header: dict, *payload: bytes, node: str = "there") -> None:
    core.on_peer(node, [msgpack.packb({"v": 1, **header}), *payload])


def client_replies(core) -> list[dict]:
    return [header for _, _, header, _ in core.ports.clients]


def test_a_request_for_a_context_another_node_owns_goes_there_and_its_replies_come_back_under_its_id(core):
    generate_on(core, THERE)
    (node, header, _), = core.ports.peers.sent
    assert node == "there" and header["id"] == FIRST_RID and header["hop"] == "here" and header["tenant"] == "acme"
    assert core.ports.scheduler == []
    peer_reply(core, {"id": FIRST_RID, "kind": "ok", "result": {"text": "forged"}}, node="elsewhere")   # a node it was not sent to
    assert client_replies(core) == []
    peer_reply(core, {"id": FIRST_RID, "kind": "chunk", "seq": 0, "data": {"text": "a"}})
    peer_reply(core, {"id": FIRST_RID, "kind": "ok", "result": {"text": "ab"}}, b"frame")
    assert [(r["id"], r["kind"]) for r in client_replies(core)] == [(7, "chunk"), (7, "ok")]
    assert core.ports.clients[-1][3] == (b"frame",) and core.pending == {}
    peer_reply(core, {"id": FIRST_RID, "kind": "ok", "result": {}})   # a late duplicate: nobody waits for it
    assert len(client_replies(core)) == 2


def test_a_request_for_a_context_owned_here_or_naming_none_goes_to_the_scheduler(core):
    generate_on(core, HERE, 1)
    frames = [wire.encode_request("generate", 2, {"prompt": "hi", "max_tokens": 2})]
    core.on_client(CLIENT, frames, [len(frames[0])], None)
    assert core.ports.peers.sent == [] and len(core.ports.scheduler) == 2


def test_a_forwarded_request_is_served_here_whoever_owns_its_context(core):
    generate_on(core, THERE, hop="elsewhere")
    assert core.ports.peers.sent == [] and len(core.ports.scheduler) == 1
    assert core.stats()["routing"].received == 1


def test_no_connection_to_the_owner_serves_the_request_here(core):
    core.ports.peers.up = set()
    generate_on(core, THERE)
    assert core.ports.peers.sent == [] and len(core.ports.scheduler) == 1
    assert core.stats()["routing"].owner_unreachable == 1


def test_the_owner_lost_ends_its_requests_retryably_at_once(core):
    generate_on(core, THERE)
    core.peer_lost("there")
    (answer,) = client_replies(core)
    assert answer["code"] == codes.UNAVAILABLE and answer["retry_after_ms"] == 1000 and core.pending == {}
    peer_reply(core, {"id": FIRST_RID, "kind": "ok", "result": {}})   # what the node sent before it went
    assert len(client_replies(core)) == 1


def test_a_cancel_ends_a_forwarded_request_here_and_tells_its_owner(core):
    generate_on(core, THERE)
    frames = [wire.encode_request("cancel", 8, {"target": 7})]
    core.on_client(CLIENT, frames, [len(frames[0])], None)
    assert sorted((r["id"], r.get("code")) for r in client_replies(core)) == [(7, codes.CANCELLED), (8, None)]
    node, cancel, _ = core.ports.peers.sent[-1]
    assert node == "there" and cancel["op"] == "cancel" and cancel["args"] == {"target": FIRST_RID}
    assert core.ports.scheduler == []


def plain(core, op: str, request_id: int, **header) -> None:
    if op == "generate":
        frames = [wire.encode_request(op, request_id, {"prompt": "hi", "max_tokens": 2}, tenant="acme", **header)]
    else:
        one_input = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}
        frames = [wire.encode_request(op, request_id, one_input, tenant="acme", **header), b"\x00" * 4]
    core.on_client(CLIENT, frames, [len(f) for f in frames], None)


def test_a_plain_request_on_a_node_over_its_threshold_goes_to_the_least_loaded_node_under_it(loaded):
    loaded.on_scheduler(messages.Members(THREE, {"here": 5, "there": 4, "third": 3}), [])
    assert loaded.stats()["routing"].offloading_to == "third"
    for request_id, op in enumerate(("generate", "infer", "generate", "generate")):
        plain(loaded, op, request_id)
    # third (3) first; then both at 4, the tie to the first by name; each one sent counts on its load here
    assert [(node, header["op"], header["hop"]) for node, header, _ in loaded.ports.peers.sent] == [
        ("third", "generate", "here"), ("there", "infer", "here"), ("third", "generate", "here")]
    assert len(loaded.ports.scheduler) == 1   # every other node then over the threshold: served here
    assert loaded.stats()["routing"].offloaded == 3
    assert loaded.stats()["routing"].offloading_to is None


def test_a_plain_request_on_a_node_under_its_threshold_is_served_here(loaded):
    loaded.on_scheduler(messages.Members(THREE, {"here": 4, "there": 0, "third": 0}), [])
    plain(loaded, "generate", 1)
    assert loaded.ports.peers.sent == [] and len(loaded.ports.scheduler) == 1


def test_a_plain_request_is_served_here_when_every_other_node_is_over_the_threshold_too(loaded):
    loaded.on_scheduler(messages.Members(THREE, {"here": 9, "there": 5, "third": 7}), [])
    plain(loaded, "generate", 1)
    assert loaded.ports.peers.sent == [] and len(loaded.ports.scheduler) == 1


def test_a_request_forwarded_here_is_never_offloaded(loaded):
    loaded.on_scheduler(messages.Members(THREE, {"here": 9, "there": 0, "third": 0}), [])
    plain(loaded, "generate", 1, hop="elsewhere")
    assert loaded.ports.peers.sent == [] and len(loaded.ports.scheduler) == 1
    assert loaded.stats()["routing"].received == 1


def test_only_a_plain_generate_or_infer_is_offloaded(loaded):
    loaded.on_scheduler(messages.Members(THREE, {"here": 9, "there": 0, "third": 0}), [])
    for request_id, op in enumerate(("ping", "status", "context.list")):
        frames = [wire.encode_request(op, request_id, {}, tenant="acme")]
        loaded.on_client(CLIENT, frames, [len(frames[0])], None)
    assert loaded.ports.peers.sent == [] and len(loaded.ports.scheduler) == 3


def test_nothing_is_offloaded_with_offloading_off():
    core = node_among_three(0)
    core.on_scheduler(messages.Members(THREE, {"here": 9, "there": 0, "third": 0}), [])
    plain(core, "generate", 1)
    assert core.ports.peers.sent == [] and len(core.ports.scheduler) == 1


def test_a_node_whose_reported_load_is_not_a_count_is_never_offloaded_to(loaded):
    reports = {"here": NodeReport(queued=0), "third": NodeReport(queued=2**40), "y": NodeReport(),
               "z": NodeReport(queued=-1)}
    assert queued_by_node(reports, "here", 9) == {"here": 9}
    loaded.on_scheduler(messages.Members(THREE, queued_by_node(reports, "here", 9)), [])
    plain(loaded, "generate", 1)
    assert loaded.ports.peers.sent == [] and len(loaded.ports.scheduler) == 1
