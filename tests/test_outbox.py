"""The front-end's outbox on real sockets in-process: replies that find a client's pipe full wait in
order, a waiting stream's chunks merge (renumbered, nothing lost), and the backlog limit is told once.

inproc pipes hold exactly SNDHWM + RCVHWM messages (no kernel buffers), so "full" is deterministic."""
import itertools

import msgpack
import pytest
import zmq

from mcpd.daemon.frontend.outbox import Outbox
from mcpd.protocol import wire

_endpoints = itertools.count()


@pytest.fixture
def pair():
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, 2)
    endpoint = f"inproc://outbox-{next(_endpoints)}"
    router.bind(endpoint)
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.RCVHWM, 2)
    client.setsockopt(zmq.ROUTING_ID, b"client")
    client.connect(endpoint)
    client.send(b"hello")   # the router learns the client's routing id
    assert router.recv_multipart() == [b"client", b"hello"]
    yield router, client
    context.destroy(linger=0)


def chunk(rid: int, seq: int, text: str) -> bytes:
    return wire.chunk_reply(rid, seq, {"text": text, "token_ids": [seq]})


def read(client) -> list[dict]:
    got = []
    while client.poll(100):
        got.append(msgpack.unpackb(client.recv(), raw=False))
    return got


def test_a_full_pipe_keeps_replies_in_order_and_merges_a_streams_chunks(pair):
    router, client = pair
    outbox = Outbox(router, limit=1 << 20)
    for i in range(4):   # fills the pipe
        outbox.send(b"client", (), wire.ok_reply(i, {}), rid=i)
    assert not outbox.backlogs
    for seq, text in enumerate("abc"):   # stream 7: three chunks wait as one
        outbox.send(b"client", (), chunk(7, seq, text), rid=7, chunk=True)
    outbox.send(b"client", (), wire.ok_reply(9, {}), rid=9)
    assert (outbox.stats().clients, outbox.stats().replies) == (1, 2)
    first = read(client)                 # the client reads; the pipe has room again
    outbox.flush()
    outbox.send(b"client", (), chunk(7, 3, "d"), rid=7, chunk=True)   # sent at once, renumbered
    outbox.send(b"client", (), wire.ok_reply(7, {"text": "abcd"}), rid=7)
    replies = first + read(client)
    assert [r["id"] for r in replies] == [0, 1, 2, 3, 7, 9, 7, 7]
    stream = [r for r in replies if r["id"] == 7]
    assert [(r["kind"], r.get("seq"), r.get("data")) for r in stream] == [
        ("chunk", 0, {"text": "abc", "token_ids": [0, 1, 2]}),
        ("chunk", 1, {"text": "d", "token_ids": [3]}),
        ("ok", None, None)]
    assert not outbox.backlogs and not outbox.merged


def test_the_backlog_limit_is_told_once_and_a_gone_client_is_dropped(pair):
    router, client = pair
    outbox = Outbox(router, limit=100)
    for i in range(4):
        outbox.send(b"client", (), wire.ok_reply(i, {}), rid=i)
    crossed = [outbox.send(b"client", (), wire.ok_reply(10 + i, {"pad": "x" * 40}), rid=10 + i) for i in range(4)]
    assert crossed == [False, True, False, False] and outbox.over_limit(b"client")
    assert not outbox.over_limit(b"someone else")
    client.close()
    outbox.send(b"nobody", (), wire.ok_reply(1, {}))   # an unknown client: dropped, not queued
    assert list(outbox.backlogs) == [b"client"]
