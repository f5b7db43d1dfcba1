"""A client that stops reading gets every final reply when it reads again, and whole streams;
past its backlog limit its requests end, and new ones are refused, with OVERLOADED (issue 13)."""
import os
from collections import defaultdict

import zmq

import pytest

from mcpd import sockets
from mcpd.protocol import codes, wire

pytestmark = pytest.mark.slow   # daemons of their own, paced rounds of slow readers

MiB = 1 << 20
PINGS_PER_ROUND = 2000


class SlowClient:
    """A DEALER that reads nothing until asked, with the smallest queue it can ask for, so that the
    daemon's side fills soon: ZeroMQ's queue, then the kernel's, then the daemon's backlog."""

    def __init__(self, d):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        # The ipc endpoint: Unix sockets buffer a fixed ~200 KB. Over loopback TCP the kernel takes
        # megabytes first, and a receive buffer small enough to prevent that stalls TCP itself.
        self.sock.connect(sockets.client_endpoint(d.runtime_dir))
        self.sent = 0
        self.waiting: set[int] = set()   # requests without a final reply yet

    def send(self, op: str, args: dict) -> int:
        request_id, self.sent = self.sent, self.sent + 1
        self.waiting.add(request_id)
        self.sock.send(wire.encode_request(op, request_id, args))
        return request_id

    def read_all(self) -> dict[int, list[dict]]:
        """Every reply until each request sent has its final (a reply after that fails)."""
        replies, waiting = defaultdict(list), self.waiting
        while waiting:
            assert self.sock.poll(30_000), f"{len(waiting)} requests never got a final reply"
            reply = wire.decode_reply(self.sock.recv_multipart()[0])
            assert reply["id"] in waiting, f"a reply after the final: {reply}"
            replies[reply["id"]].append(reply)
            if reply["kind"] != "chunk":
                waiting.discard(reply["id"])
        assert not self.sock.poll(200), "a reply after every request had its final"
        return replies

    def close(self) -> None:
        self.sock.close()


def answered(d) -> bool:
    return d.status()["queue"]["inflight"] == 0


def stall(d, slow: SlowClient) -> None:
    """Send pings without reading until the daemon keeps replies for this client in its backlog
    (ZeroMQ's queue and the kernel's buffers are full): a round or two."""
    for _ in range(30):
        ping_round(d, slow)
        if d.status()["requests"]["backlog"].get("clients"):
            return
    raise AssertionError("the daemon never had to keep replies back for the client")


def ping_round(d, slow: SlowClient) -> None:
    """PINGS_PER_ROUND pings, answered before this returns (not refused for a full queue)."""
    for _ in range(PINGS_PER_ROUND):
        slow.send("ping", {})
    with d.client() as pacer:
        d.wait_until(lambda: pacer.status()["inflight"] == 0, 60, "the round answered")


def test_a_client_that_stops_reading_gets_every_final_and_whole_streams(fresh_daemon):
    d = fresh_daemon()
    slow = SlowClient(d)
    stall(d, slow)
    streams = [slow.send("generate", {"prompt": f"s{i}", "max_tokens": 40, "ignore_eos": True,
                                      "stream": True, "logprobs": True}) for i in range(4)]
    d.wait_until(lambda: answered(d), 120, "the streams answered")
    replies = slow.read_all()
    for rid in streams:
        *chunks, final = replies[rid]
        result = final["result"]
        assert [chunk["seq"] for chunk in chunks] == list(range(len(chunks)))
        assert "".join(chunk["data"]["text"] for chunk in chunks) == result["text"]
        assert sum((chunk["data"]["token_ids"] for chunk in chunks), []) == result["token_ids"]
        assert sum((chunk["data"]["logprobs"] for chunk in chunks), []) == result["logprobs"]
        assert result["usage"]["completion_tokens"] == 40
    assert d.status()["requests"]["backlog"] == {"clients": 0, "replies": 0, "bytes": 0}
    slow.close()


def test_a_client_over_its_backlog_limit_has_its_requests_ended_and_refused(fresh_daemon):
    d = fresh_daemon(limits={"max_client_backlog_bytes": 2 * MiB})
    with d.client() as owner:   # the slow client's tenant too: "default"
        big = owner.context("big")
        big["blob"] = os.urandom(MiB)   # incompressible: its replies carry a MiB each
        big.sync()
    slow = SlowClient(d)
    stall(d, slow)   # a backlog, well under 2 MiB: at most a few rounds of small replies
    ping_round(d, slow)   # and a round more, so that it outlasts what the kernel takes meanwhile
    streams = [slow.send("generate", {"prompt": f"long {i}", "max_tokens": 2000, "ignore_eos": True,
                                      "stream": True}) for i in range(2)]
    gets = [slow.send("context.get", {"id": "big"}) for _ in range(3)]   # 3 MiB more: past the limit
    d.wait_until(lambda: answered(d), 60, "the streams ended")
    refused = slow.send("ping", {})
    d.wait_until(lambda: answered(d), 60, "the last ping refused")
    replies = slow.read_all()
    # Finals already waiting stay: the first two gets fit under the limit whatever the timing. The
    # second takes the backlog past it, so the third is refused if it is read after that and
    # answered if it was read first (one pass of the front-end may read all three): both are right.
    assert [replies[rid][-1]["kind"] for rid in gets[:2]] == ["ok"] * 2
    third = replies[gets[2]][-1]
    assert third["kind"] == "ok" or third["code"] == codes.OVERLOADED, third
    for rid in streams:   # ended, queued or running
        final = replies[rid][-1]
        assert final["code"] == codes.OVERLOADED and final["retry_after_ms"] > 0, final
        assert "ended: the client does not read its replies" in final["message"]
    assert replies[refused][-1]["code"] == codes.OVERLOADED
    again = slow.send("ping", {})   # it read everything: served again
    assert slow.read_all()[again][-1]["kind"] == "ok"
    slow.close()
