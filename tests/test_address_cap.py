"""The cap on TCP connections per client address (address_cap.py): in-process on real sockets,
and on a daemon."""
import logging
import socket

import pytest
import zmq

from mcpd.client import Client
from mcpd.daemon.frontend.address_cap import AddressCap
from mcpd.protocol import wire
from mcpd.sockets import with_ipv6
from mcpd.testing import free_port

ENDPOINT = b"tcp://127.0.0.1:1"


def loopback(host: str) -> str:
    """The loopback address, where this machine has it (a container may run without IPv6)."""
    try:
        socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET).close()
    except OSError:
        pytest.skip(f"no {host} loopback here")
    return host


def connection_pairs(count: int, host: str = "127.0.0.1") -> tuple[socket.socket, list[tuple[socket.socket, socket.socket]]]:
    listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    pairs = []
    for _ in range(count):
        client = socket.create_connection(listener.getsockname()[:2])
        pairs.append((client, listener.accept()[0]))
    return listener, pairs


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_a_connection_past_the_cap_is_cut_and_a_closed_one_frees_its_place(host):
    """One address however many connections it opens: over IPv6 too, whose descriptors are no
    IPv4 sockets (read as one, each connection's address came out different)."""
    cap = AddressCap(2, logging.getLogger("test"))
    listener, pairs = connection_pairs(4, loopback(host))
    try:
        for _, server in pairs[:3]:
            cap.accepted(server.fileno(), ENDPOINT)
        pairs[2][0].settimeout(10)
        assert pairs[2][0].recv(1) == b""            # the third was cut: the client sees the end
        assert cap.stats() == {"addresses": 1, "cut_over_address_cap": 1}
        cap.disconnected(pairs[0][1].fileno())       # the first closes
        cap.accepted(pairs[3][1].fileno(), ENDPOINT)  # the fourth takes its place
        pairs[3][1].sendall(b"x")
        assert pairs[3][0].recv(1) == b"x"
        assert cap.stats()["cut_over_address_cap"] == 1
    finally:
        for pair in pairs:
            for sock in pair:
                sock.close()
        listener.close()



def test_an_ipv4_client_is_one_address_whichever_socket_it_reaches():
    """A socket open to IPv6 names an IPv4 peer ::ffff:127.0.0.1; it shares 127.0.0.1's count."""
    cap = AddressCap(1, logging.getLogger("test"))
    assert cap.admits("127.0.0.1")
    assert not cap.admits("::ffff:127.0.0.1")
    cap.released("::ffff:127.0.0.1")
    assert cap.admits("127.0.0.1") and cap.stats()["addresses"] == 1
    assert cap.admits("::1") and cap.admits("not an address")   # others are their own

def test_ipc_connections_are_not_capped(tmp_path):
    cap = AddressCap(1, logging.getLogger("test"))
    path = str(tmp_path / "client.ipc")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    pairs = []
    try:
        for _ in range(2):
            client = socket.socket(socket.AF_UNIX)
            client.connect(path)
            pairs.append((client, listener.accept()[0]))
            cap.accepted(pairs[-1][1].fileno(), f"ipc://{path}".encode())
        assert cap.stats() == {"addresses": 0, "cut_over_address_cap": 0}
        for client, server in pairs:   # neither was cut
            server.sendall(b"x")
            assert client.recv(1) == b"x"
    finally:
        for pair in pairs:
            for sock in pair:
                sock.close()
        listener.close()


def dealer(endpoint: str) -> zmq.Socket:
    sock = with_ipv6(zmq.Context.instance().socket(zmq.DEALER))
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def pinged(sock: zmq.Socket, request_id: int, timeout_ms: int) -> bool:
    sock.send(wire.encode_request("ping", request_id, {}))
    return bool(sock.poll(timeout_ms)) and wire.decode_reply(sock.recv())["kind"] == "ok"


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]"])
def test_the_daemon_serves_the_cap_and_cuts_past_it(fresh_daemon, host):
    loopback(host.strip("[]"))
    endpoint = f"tcp://{host}:{free_port()}"
    daemon = fresh_daemon(server={"tcp": endpoint}, limits={"max_connections_per_address": 4})
    with Client(endpoint, timeout=30) as client:     # the client library's connection: one of the 4
        assert client.ping()["pong"] is True
        held = [dealer(endpoint) for _ in range(3)]
        assert all(pinged(sock, 1, 10000) for sock in held)
        extra = dealer(endpoint)
        assert not pinged(extra, 1, 2000)            # cut: its request is never answered
        extra.close()
        daemon.wait_until(lambda: daemon.status()["requests"]["incoming"]["cut_over_address_cap"] >= 1, 30,
                          "the cut counted")
        held.pop().close()
        served = False
        for request_id in range(30):                 # once the close is read, a place is free
            replacement = dealer(endpoint)
            served = pinged(replacement, request_id, 1000)
            replacement.close()
            if served:
                break
        assert served
        assert all(pinged(sock, 2, 10000) for sock in held)   # the first ones were never touched
        assert client.ping()["pong"] is True
        for sock in held:
            sock.close()
