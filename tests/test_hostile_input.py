"""Garbage at the front door gets the documented error code, and the daemon keeps serving."""
from functools import reduce

import msgpack
import pytest
import zmq

from mcpd.protocol import codes


@pytest.fixture
def raw(daemon):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    sock.connect(daemon.endpoint)
    yield sock
    sock.close()


def exchange(sock, *frames) -> dict:
    sock.send_multipart(list(frames))
    reply = sock.recv_multipart()
    return msgpack.unpackb(reply[0], raw=False)


def header(**fields) -> bytes:
    return msgpack.packb({"v": 1, "op": "ping", "id": 1, **fields})


@pytest.mark.parametrize("frame, code", [
    (b"\xc1\xc1 not msgpack", codes.BAD_REQUEST),
    (msgpack.packb([1, 2, 3]), codes.BAD_REQUEST),
    (msgpack.packb({"v": 1, "op": "ping"}), codes.BAD_REQUEST),                 # no id
    (header(id=[1]), codes.BAD_REQUEST),
    (header(op=7), codes.BAD_REQUEST),
    (header(args=[]), codes.BAD_REQUEST),
    (header(v="1"), codes.BAD_REQUEST),
    (header(v=99), codes.UNSUPPORTED_VERSION),
    (header(op="launch_missiles"), codes.UNKNOWN_OP),
    (header(op="generate", args={"prompt": "x", "max_tokens": "ten"}), codes.BAD_REQUEST),
    (header(op="generate", args={"prompt": "x", "max_tokens": 10**9}), codes.BAD_REQUEST),
    (header(op="generate", args={"prompt": "x", "temperature": -1}), codes.BAD_REQUEST),
    (header(op="generate", args={"prompt": "x", "prompt_token_ids": [1]}), codes.BAD_REQUEST),
    (header(op="generate", args={}), codes.BAD_REQUEST),
    (header(op="generate", args={"prompt": "x", "bogus": 1}), codes.BAD_REQUEST),
    (header(op="generate", args={"prompt_token_ids": [-1]}), codes.BAD_REQUEST),
    (header(op="generate", args={"prompt_token_ids": [10**6]}), codes.BAD_REQUEST),  # outside vocab: worker
    (header(op="generate", args={"messages": [{"role": 1}]}), codes.BAD_REQUEST),
    (header(op="generate", args={"messages": [{"role": "user", "content": "x",
                                               "extra": reduce(lambda inner, _: [inner], range(1000), [])}]}),
     codes.BAD_REQUEST),                                                       # as deep as Python recurses
    (header(op="context.update", args={"id": "absent", "base": 0, "changes": [
        {"name": "w", "kind": "set", "meta": {"type": "scalar", "value": [1]}}]}), codes.BAD_REQUEST),   # not NOT_FOUND
    (header(op="cancel", args={}), codes.BAD_REQUEST),
    (header(timeout_ms=-5), codes.BAD_REQUEST),
    (b"\xdf\xff\xff\xff\xff", codes.BAD_REQUEST),                               # map claiming 4G entries
    (b"\xdd\x00\x00\x9c\x40" + b"\x00" * 8, codes.BAD_REQUEST),                  # array claiming 40000 items
    (b"\x85" + msgpack.packb("v")[0:] + b"\x01" + b"\xde\x13\x88", codes.BAD_REQUEST),  # map claiming 5000 entries
])
def test_bad_header_gets_error_code(daemon, raw, frame, code):
    reply = exchange(raw, frame)
    assert reply["kind"] == "error" and reply["code"] == code, reply
    assert isinstance(reply["message"], str) and reply["message"]
    assert daemon.client().ping()["pong"] is True


def test_error_reply_names_the_request_id_when_known(raw):
    reply = exchange(raw, header(id="mine", op="nope"))
    assert reply["id"] == "mine" and reply["code"] == codes.UNKNOWN_OP


def test_oversize_header_and_too_many_frames(daemon, raw):
    big = msgpack.packb({"v": 1, "op": "ping", "id": 1, "pad": "x" * 9000})
    assert exchange(raw, big)["code"] == codes.TOO_LARGE
    assert exchange(raw, header(), *[b"p"] * 20)["code"] == codes.TOO_LARGE
    assert exchange(raw, header(), b"a" * 600_000, b"b" * 600_000)["code"] == codes.TOO_LARGE


def test_frame_over_maxmsgsize_drops_only_that_peer(daemon, raw):
    raw.send_multipart([header(), b"z" * (2 << 20)])   # over MAXMSGSIZE: libzmq disconnects the peer
    assert not raw.poll(3000)   # dropped unread: the front-end never answers it (its reconnect is a new peer)
    with daemon.client() as other:
        assert other.ping()["pong"] is True


def test_duplicate_request_id_in_flight_is_a_conflict(raw):
    raw.send_multipart([msgpack.packb({"v": 1, "op": "generate", "id": 5,
                                       "args": {"prompt": "a", "max_tokens": 500, "ignore_eos": True}})])
    second = exchange(raw, msgpack.packb({"v": 1, "op": "generate", "id": 5, "args": {"prompt": "b"}}))
    assert second["code"] == codes.CONFLICT
    raw.send_multipart([msgpack.packb({"v": 1, "op": "cancel", "id": 6, "args": {"target": 5}})])


def test_req_socket_envelope_is_echoed(daemon):
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    sock.connect(daemon.endpoint)
    sock.send(header(id=3))
    reply = msgpack.unpackb(sock.recv(), raw=False)
    sock.close()
    assert reply["kind"] == "ok" and reply["id"] == 3 and reply["result"]["pong"] is True


def test_control_socket_rejects_bad_version_with_the_id(daemon):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    sock.connect(f"ipc://{daemon.runtime_dir}/control.ipc")
    reply = exchange(sock, header(v=2, id=42))
    sock.close()
    assert reply["code"] == codes.UNSUPPORTED_VERSION and reply["id"] == 42


def test_bin_argument_names_get_bad_request(daemon, raw):
    frame = msgpack.packb({"v": 1, "op": "ping", "id": 1, "args": {b"a": 1, "b": 2}}, use_bin_type=True)
    assert exchange(raw, frame)["code"] == codes.BAD_REQUEST
    assert daemon.client().ping()["pong"] is True


# libzmq's routing ids for clients that set none, in a process that never seeded libc's rand().
UNSEEDED_IDS = [b"\x00" + (0x6B8B4567 + n).to_bytes(4, "big") for n in range(16)]


def pinged(endpoint: str, routing_id: bytes | None = None) -> zmq.Socket:
    """A DEALER on endpoint (with routing_id, if given) that a ping was answered on."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.connect(endpoint)
    assert exchange(sock, header(id=1))["result"]["pong"] is True
    return sock


@pytest.mark.parametrize("socket_file", [None, "control.ipc"])
def test_a_client_naming_itself_as_libzmq_names_clients_does_not_abort_the_daemon(fresh_daemon, socket_file):
    """A client that takes the routing id libzmq would give the next anonymous client made the
    front-end (client socket) or the supervisor (mcpctl's socket) abort when that client came:
    libzmq asserts, and unseeded, the ids are the same in every process. Claim the first 16, then
    let 24 anonymous clients come: all are served."""
    daemon = fresh_daemon()
    endpoint = daemon.endpoint if socket_file is None else f"ipc://{daemon.runtime_dir}/{socket_file}"
    claimers = [pinged(endpoint, routing_id) for routing_id in UNSEEDED_IDS]
    for _ in range(24):
        pinged(endpoint).close()
    assert exchange(claimers[0], header(id=2))["result"]["pong"] is True
    for sock in claimers:
        sock.close()
