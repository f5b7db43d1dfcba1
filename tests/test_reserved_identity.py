"""No routing id is reserved: a ZeroMQ client that names itself as the in-process HTTP listener
was once named (b"\\x00local") is an ordinary client, with HTTP on (it cannot reach the
listener's requests) and off (its replies reach it and nothing is left in flight)."""
from contextlib import contextmanager

import openai
import pytest
import zmq

from mcpd.protocol import wire
from mcpd.testing import free_port

MODEL = "mcpd-embedded-llama"
LISTENERS_OLD_ID = b"\x00local"
STREAM_TOKENS = 256
pytestmark = pytest.mark.slow


@contextmanager
def impostor(daemon):
    """A DEALER with the listener's old routing id, closed (its connection with it) on leaving."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, LISTENERS_OLD_ID)
    sock.connect(daemon.endpoint)
    try:
        yield sock
    finally:
        sock.close()


def ask(sock: zmq.Socket, op: str, request_id: int, args: dict) -> dict:
    """One request's final reply, which must come to the socket that sent it."""
    sock.send(wire.encode_request(op, request_id, args))
    assert sock.poll(20_000), f"no reply to {op} {request_id}"
    return wire.decode_reply(sock.recv())


def test_a_client_with_the_listeners_old_id_cannot_cancel_or_answer_http_requests(fresh_daemon):
    daemon = fresh_daemon(http={"listen": f"127.0.0.1:{free_port()}"})
    base_url = f"http://{daemon.control('config')['config']['http']['listen']}/v1"
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as sdk:
        stream = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=STREAM_TOKENS, temperature=0, stream=True,
                                             stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = [next(stream)]   # admitted and streaming: the attack comes while it runs
        with impostor(daemon) as sock:
            assert ask(sock, "ping", 1, {})["result"]["pong"] is True
            for target in range(1, 33):   # the listener numbers its requests from 1
                reply = ask(sock, "cancel", 100 + target, {"target": target})
                assert (reply["id"], reply["result"]) == (100 + target, {"cancelled": False})
        chunks += list(stream)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == STREAM_TOKENS


def test_with_http_off_a_client_with_the_listeners_old_id_is_served_and_leaves_nothing_in_flight(fresh_daemon):
    daemon = fresh_daemon()
    with impostor(daemon) as sock:
        reply = ask(sock, "generate", 1, {"prompt": "x", "max_tokens": 1})
    assert (reply["kind"], reply["id"], reply["result"]["usage"]["completion_tokens"]) == ("ok", 1, 1)
    assert daemon.status()["queue"]["inflight"] == 0
    drained = daemon.mcpctl("--timeout", "20", "drain", "--wait", timeout=60)
    assert drained.returncode == 0, drained.stdout + drained.stderr
    assert "Traceback" not in daemon.log()
