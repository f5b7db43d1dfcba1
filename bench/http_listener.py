"""The HTTP listener against the ZeroMQ path, side by side on one daemon in the same run.

    python bench/http_listener.py [--quick]

1. A 1-token request (prompt token [1], max_tokens 1, greedy) sent one after another,
   alternating request by request: over ZeroMQ (a raw pyzmq DEALER on the tcp endpoint, `generate`) and over
   HTTP (a raw keep-alive socket, POST /v1/completions), both with clients that do no more than
   frame and read, so the difference is the server's. http_p50_ratio_vs_zmq: HTTP p50 over
   ZeroMQ p50 (target <= 1.3).
2. A chat of 10 turns over HTTP, once on a context (POST /v1/contexts/{id}/chat/completions:
   each turn sends only its new user message) and once resending the whole history on
   /v1/chat/completions, as an OpenAI client does; every byte of the requests is counted as
   sent (request line, headers and body). context_bytes_ratio_vs_resend: resend bytes over
   context bytes (target >= 5).
3. What the listener, on the front-end's loop, costs ZeroMQ clients: their 1-token p50 while
   two closed-loop HTTP clients run against while two ZeroMQ clients send the same requests
   (alternating rounds): zmq_p50_ratio_http_load_vs_zmq_load, 1 if HTTP costs the loop no more
   than ZeroMQ traffic does.

Ends with one JSON line. vLLM is not compared here (not installed on this machine).
"""
from __future__ import annotations

import argparse
import itertools
import json
import socket
import statistics
import threading
import time

import zmq

from mcpd.protocol import wire
from mcpd.testing import Daemon, free_port

WARM = 50
ROUNDS = 3
LOADERS = 2
TURNS = 10
MODEL = "mcpd-embedded-llama"
USER_TURN = "Please summarise what we said so far and add one more idea about the weekend trip. " * 2


class HttpSocket:
    """A keep-alive HTTP/1.1 connection that frames a JSON POST and reads a Content-Length reply."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sent = 0

    def post(self, path: str, body: dict) -> tuple[dict, dict]:
        data = json.dumps(body).encode()
        request = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(data)}\r\n\r\n").encode() + data
        self.sock.sendall(request)
        self.sent += len(request)
        buffer = b""
        while b"\r\n\r\n" not in buffer:
            buffer += self.sock.recv(65536)
        head, _, rest = buffer.partition(b"\r\n\r\n")
        headers = dict(line.decode().lower().split(": ", 1) for line in head.split(b"\r\n")[1:])
        length = int(headers["content-length"])
        while len(rest) < length:
            rest += self.sock.recv(65536)
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"{path}: {head.splitlines()[0].decode()} {rest[:300]!r}")
        return headers, json.loads(rest)


def zmq_request(sock: zmq.Socket, request_id: int) -> float:
    frame = wire.encode_request("generate", request_id, {"prompt_token_ids": [1], "max_tokens": 1, "temperature": 0})
    started = time.perf_counter()
    sock.send(frame)
    reply = wire.decode_reply(sock.recv_multipart()[0])
    elapsed = time.perf_counter() - started
    assert reply["kind"] == "ok", reply
    return elapsed


def http_request(conn: HttpSocket) -> float:
    started = time.perf_counter()
    conn.post("/v1/completions", {"model": MODEL, "prompt": [1], "max_tokens": 1, "temperature": 0})
    return time.perf_counter() - started


def one_token(daemon: Daemon, port: int, count: int) -> dict:
    """Requests alternate one by one between the two paths, so a neighbour's burst on this
    shared machine lands on both alike."""
    sock = zmq_socket(daemon)
    conn = HttpSocket(port)
    zmq_times, http_times = [], []
    for i in range(WARM + count):
        zmq_time, http_time = zmq_request(sock, i), http_request(conn)
        if i >= WARM:   # the model's first steps, the listener's model list
            zmq_times.append(zmq_time)
            http_times.append(http_time)
    zmq_p50, http_p50 = statistics.median(zmq_times), statistics.median(http_times)
    print(f"1-token request p50: zmq {zmq_p50 * 1e3:.3f} ms, http {http_p50 * 1e3:.3f} ms "
          f"(+{(http_p50 - zmq_p50) * 1e6:.0f} us), {count} each, alternating")
    return {"zmq_p50_ms": round(zmq_p50 * 1e3, 3), "http_p50_ms": round(http_p50 * 1e3, 3),
            "http_p50_ratio_vs_zmq": round(http_p50 / zmq_p50, 3)}


def zmq_socket(daemon: Daemon) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    return sock


def zmq_p50_beside(daemon: Daemon, port: int, count: int, load: str) -> float:
    """ZeroMQ 1-token p50 while LOADERS closed-loop clients send the same request over `load`."""
    stop = threading.Event()

    def loader() -> None:   # each thread its own connection or socket
        if load == "http":
            conn = HttpSocket(port)
            while not stop.is_set():
                http_request(conn)
        else:
            sock = zmq_socket(daemon)
            for request_id in itertools.count():
                if stop.is_set():
                    return
                zmq_request(sock, request_id)
    threads = [threading.Thread(target=loader) for _ in range(LOADERS)]
    for thread in threads:
        thread.start()
    sock = zmq_socket(daemon)
    try:
        return statistics.median([zmq_request(sock, i) for i in range(count)])
    finally:
        stop.set()
        for thread in threads:
            thread.join()


def neighbour_cost(daemon: Daemon, port: int, count: int) -> dict:
    """What HTTP traffic on the front-end's loop costs ZeroMQ clients: their p50 beside HTTP load
    against beside the same load over ZeroMQ (alternating rounds)."""
    beside = {"http": [], "zmq": []}
    for _ in range(ROUNDS):
        for load in beside:
            beside[load].append(zmq_p50_beside(daemon, port, count, load))
    http_load, zmq_load = statistics.median(beside["http"]), statistics.median(beside["zmq"])
    print(f"ZeroMQ 1-token p50 beside {LOADERS} HTTP clients {http_load * 1e3:.3f} ms, beside {LOADERS} "
          f"ZeroMQ clients {zmq_load * 1e3:.3f} ms")
    return {"zmq_p50_ms_beside_http_load": round(http_load * 1e3, 3),
            "zmq_p50_ms_beside_zmq_load": round(zmq_load * 1e3, 3),
            "zmq_p50_ratio_http_load_vs_zmq_load": round(http_load / zmq_load, 3)}


def chat_bytes(port: int, max_tokens: int) -> dict:
    on_context, resend = HttpSocket(port), HttpSocket(port)
    history = []
    for turn in range(TURNS):
        message = {"role": "user", "content": f"Turn {turn}. {USER_TURN}"}
        options = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0}
        on_context.post("/v1/contexts/bench-chat/chat/completions", {**options, "messages": [message]})
        history.append(message)
        _, answer = resend.post("/v1/chat/completions", {**options, "messages": history})
        history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    print(f"{TURNS}-turn chat: {on_context.sent} bytes sent on a context, {resend.sent} resending the history")
    return {"context_bytes": on_context.sent, "resend_bytes": resend.sent,
            "context_bytes_ratio_vs_resend": round(resend.sent / on_context.sent, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (< 1 min)")
    args = parser.parse_args()
    port = free_port()
    daemon = Daemon(http={"listen": f"127.0.0.1:{port}"}).start()
    try:
        figures = one_token(daemon, port, 500 if args.quick else 3000)
        figures.update(chat_bytes(port, 64))
        figures.update(neighbour_cost(daemon, port, 150 if args.quick else 1000))
    finally:
        daemon.stop()
        daemon.cleanup()
    print(json.dumps({"bench": "http", "quick": args.quick, **figures}))


if __name__ == "__main__":
    main()
