"""A client that stops reading gets every final reply when it reads again, and whole streams;
past its backlog limit its requests end, and new ones are refused, with OVERLOADED (issue 13)."""
from collections import defaultdict

import zmq

from mcpd.protocol import codes, wire

FIRST_ROUND, PINGS_PER_ROUND = 20000, 4000   # Linux took some 17,000 pings' replies before the backlog


class SlowClient:
    """A DEALER that reads nothing until asked, with the smallest buffers it can ask for, so that
    the daemon's side fills soon: ZeroMQ's queue, then the kernel's, then the daemon's backlog."""

    def __init__(self, d):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        self.sock.setsockopt(zmq.RCVBUF, 2048)
        self.sock.connect(d.endpoint)
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
    (ZeroMQ's queue and the kernel's buffers are full). How many that takes depends on the kernel."""
    for round in range(25):
        for _ in range(PINGS_PER_ROUND if round else FIRST_ROUND):
            slow.send("ping", {})
        d.wait_until(lambda: answered(d), 60, "the pings answered")
        if d.status()["requests"]["backlog"].get("clients"):
            return
    raise AssertionError("the daemon never had to keep replies back for the client")


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
    d = fresh_daemon(limits={"max_client_backlog_bytes": 16384})
    slow = SlowClient(d)
    streams = [slow.send("generate", {"prompt": f"long {i}", "max_tokens": 2000, "ignore_eos": True,
                                      "stream": True}) for i in range(2)]
    stall(d, slow)   # then a few thousand more replies, all kept back: far past the limit, however
    for _ in range(PINGS_PER_ROUND):   # much more the kernel takes meanwhile
        slow.send("ping", {})
    refused = slow.send("ping", {})
    d.wait_until(lambda: answered(d), 60, "everything answered or ended")
    replies = slow.read_all()
    for rid in streams:   # ended while running
        final = replies[rid][-1]
        assert final["code"] == codes.OVERLOADED and final["retry_after_ms"] > 0, final
        assert "does not read its replies (limits.max_client_backlog_bytes) (while running)" in final["message"]
    assert replies[refused][-1]["code"] == codes.OVERLOADED
    again = slow.send("ping", {})   # it read everything: served again
    assert slow.read_all()[again][-1]["kind"] == "ok"
    slow.close()
