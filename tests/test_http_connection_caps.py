"""The HTTP listener's connection limits on a real daemon: limits.max_connections_per_address
counted with ZeroMQ connections, and a flood of idle connections against a front-end whose
descriptor limit is lowered (prlimit) that leaves ZeroMQ and HTTP clients of another address
served (mcpd/http/connections.py, mcpd/http/acceptor.py)."""
import json
import selectors
import socket
import struct
import subprocess

import pytest
import zmq

from mcpd.protocol import wire
from mcpd.testing import free_port

pytestmark = pytest.mark.slow
OTHER = "127.0.0.2"   # another client address on loopback
RESET_ON_CLOSE = struct.pack("ii", 1, 0)   # SO_LINGER 0: closed sockets leave no TIME_WAIT behind


def http_address(daemon) -> tuple[str, int]:
    host, port = daemon.control("config")["config"]["http"]["listen"].split(":")
    return host, int(port)


def connect(daemon, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(http_address(daemon), timeout=10, source_address=(source, 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET_ON_CLOSE)
    return sock


def get_models(sock: socket.socket) -> int:
    """The status of GET /v1/models on the keep-alive connection sock."""
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: mcpd\r\n\r\n")
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(65536)
        assert chunk, "closed before an answer"
        head += chunk
    headers, _, body = head.partition(b"\r\n\r\n")
    lengths = [line.split(b":")[1] for line in headers.split(b"\r\n") if line.lower().startswith(b"content-length")]
    length = int(lengths[0])
    while len(body) < length:
        body += sock.recv(65536)
    return int(headers.split(b" ")[1])


def answer_then_end(sock: socket.socket) -> bytes:
    """Everything the server sends before it closes the connection (the test fails on a timeout)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def dealer(daemon, source: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{source}:0;127.0.0.1:{daemon.port}")   # libzmq's source;destination
    return sock


def pinged(sock: zmq.Socket, timeout_ms: int) -> bool:
    sock.send(wire.encode_request("ping", 1, {}))
    return bool(sock.poll(timeout_ms)) and wire.decode_reply(sock.recv())["kind"] == "ok"


def test_an_address_over_its_cap_is_refused_over_http_counting_its_zeromq_connections(fresh_daemon):
    daemon = fresh_daemon(http={"listen": f"127.0.0.1:{free_port()}"}, limits={"max_connections_per_address": 8})
    zeromq = [dealer(daemon, "127.0.0.1") for _ in range(3)]
    held = []
    try:
        assert all(pinged(sock, 10000) for sock in zeromq)   # answered: their accepts are counted
        held = [connect(daemon) for _ in range(5)]
        assert all(get_models(sock) == 200 for sock in held)
        refused = connect(daemon)
        answer = answer_then_end(refused)   # the 9th connection of 127.0.0.1: answered and closed at once
        refused.close()
        assert answer.startswith(b"HTTP/1.1 429 ")
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "RATE_LIMITED"
        other = connect(daemon, OTHER)
        assert get_models(other) == 200
        other.close()
        assert all(get_models(sock) == 200 for sock in held)   # the first ones were never touched
        held.pop().close()
        daemon.wait_until(lambda: daemon.status()["http"]["connections"] == 4, 30, "the closed one forgotten")
        replacement = connect(daemon)
        assert get_models(replacement) == 200
        replacement.close()
    finally:
        for sock in held + zeromq:
            sock.close()


def open_idle(address: tuple[str, int], count: int, batch: int = 100) -> list[socket.socket]:
    """count connections from 127.0.0.1 that never send, opened a batch at a time (the server's
    backlog holds a batch), each batch's connects waited for (bounded)."""
    opened = []
    for start in range(0, count, batch):
        selector = selectors.DefaultSelector()
        for _ in range(min(batch, count - start)):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET_ON_CLOSE)
            sock.setblocking(False)
            sock.connect_ex(address)
            selector.register(sock, selectors.EVENT_WRITE)
            opened.append(sock)
        while selector.get_map() and (ready := selector.select(timeout=10)):
            for key, _ in ready:
                selector.unregister(key.fileobj)
        selector.close()
    return opened


def turned_away(daemon) -> int:
    http = daemon.status()["http"]
    return http["idle_shed"] + http["refused"]


def test_a_flood_of_idle_connections_leaves_other_clients_served(fresh_daemon):
    daemon = fresh_daemon(http={"listen": f"127.0.0.1:{free_port()}"},
                          limits={"max_connections_per_address": 4096})   # the total cap alone holds the flood
    frontend = daemon.pid_of("frontend")
    subprocess.run(["prlimit", f"--pid={frontend}", "--nofile=1024:1024"], check=True, timeout=10)
    flood = open_idle(http_address(daemon), 1100)
    ping = dealer(daemon, OTHER)
    try:
        assert pinged(ping, 5000)
        other = connect(daemon, OTHER)
        assert get_models(other) == 200
        other.close()
        daemon.wait_until(lambda: turned_away(daemon) >= 1100 - 512, 30, "the flood taken")
        http = daemon.status()["http"]
        assert http["max_connections"] == 512                  # half the 1,024 descriptors
        assert http["connections"] <= 512 and http["idle_shed"] > 0
        assert daemon.pid_of("frontend") == frontend            # never restarted
    finally:
        ping.close()
        for sock in flood:
            sock.close()
