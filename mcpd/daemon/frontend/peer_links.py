"""The front-end's connections to the other nodes' front-ends: a DEALER per node, to its
cluster.advertise_tcp, carrying the requests forwarded there (forwarding.py) and their replies.

- ZMQ_IMMEDIATE: a send goes over a complete connection only; with none (the node not reached
  yet, or gone) it fails at once, and the request is served here instead of waiting in a queue.
- A monitor per socket reports the connection's end (a node that dies has its sockets closed by
  the kernel), and ZMTP heartbeats end a connection whose node stopped answering: either way the
  requests there get their final at once (the listener's peer_lost).
- CURVE on: a link authenticates with this node's own server key pair, against the server key the
  other node advertises in its heartbeat; the other node must allow this node's key under a name
  in its cluster.peer_tenants (gate.py). A node advertising no key gets no link (served here).
  libzmq never retries a handshake the other node refused: such a link is made again at the next
  membership update (the scheduler's stats interval), so allowing the key later is enough.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import zmq
from zmq.utils.monitor import parse_monitor_message

from mcpd.daemon.messages import OwnerNode
from mcpd.sockets import NOBLOCK, drain, send_frames, with_ipv6

HEARTBEAT_IVL_MS = 1000       # a ZMTP ping this often on an idle link
HEARTBEAT_TIMEOUT_MS = 3000   # a node silent this long has its link, and its requests from here, ended
REFUSED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
WATCHED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | REFUSED


class Listener(Protocol):
    def peer_reply(self, node_id: str, frames: list[bytes]) -> None: ...

    def peer_lost(self, node_id: str) -> None: ...

    def peer_read_done(self) -> None:
        """Replies were relayed: whatever sends to clients reads them after (process.py says why)."""


@dataclass
class Link:
    node: OwnerNode
    sock: zmq.Socket
    monitor: zmq.Socket
    connected: bool = False
    refused: bool = False   # the other node refused the handshake: libzmq gave up on it


class PeerLinks:
    def __init__(self, context: zmq.Context, node_id: str, listener: Listener, own_keys: tuple[str, str] | None):
        """`own_keys`: this node's CURVE server key pair (public, secret) with CURVE on, else None."""
        self.context, self.node_id, self.listener, self.own_keys = context, node_id, listener, own_keys
        self.links: dict[str, Link] = {}

    def sync(self, nodes: dict[str, OwnerNode]) -> None:
        for node_id, link in list(self.links.items()):
            if nodes.get(node_id) != link.node or link.refused:
                self._close(node_id)
        for node_id, node in nodes.items():
            if node_id != self.node_id and node_id not in self.links and (self.own_keys is None or node.curve_key):
                self._open(node_id, node)

    def send(self, node_id: str, frames: list[bytes]) -> bool:
        link = self.links.get(node_id)
        if link is None:
            return False
        try:
            send_frames(link.sock, frames, NOBLOCK)
        except zmq.Again:   # no complete connection (ZMQ_IMMEDIATE), or its pipe is full
            return False
        # A send processes the socket's commands, so a reply that came meanwhile may not fire its
        # FD: read after, once the caller is done (not inside it).
        asyncio.get_running_loop().call_soon(self.read, node_id)
        return True

    def connected(self) -> list[str]:
        return sorted(node_id for node_id, link in self.links.items() if link.connected)

    def read(self, node_id: str) -> None:
        link = self.links.get(node_id)
        if link is not None and drain(link.sock, partial(self.listener.peer_reply, node_id)):
            self.listener.peer_read_done()

    def read_all(self) -> None:
        """Every link and its monitor (belt and braces against a missed edge)."""
        for node_id in list(self.links):
            self._watch(node_id)
            self.read(node_id)

    def _open(self, node_id: str, node: OwnerNode) -> None:
        sock = with_ipv6(self.context.socket(zmq.DEALER))
        sock.setsockopt(zmq.LINGER, 0)
        if self.own_keys is not None:
            sock.curve_serverkey = node.curve_key.encode()
            sock.curve_publickey, sock.curve_secretkey = (key.encode() for key in self.own_keys)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        monitor = sock.get_monitor_socket(WATCHED)
        sock.connect(node.tcp)
        self.links[node_id] = Link(node, sock, monitor)
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.getsockopt(zmq.FD), partial(self.read, node_id))
        loop.add_reader(monitor.getsockopt(zmq.FD), partial(self._watch, node_id))
        self._watch(node_id)

    def _close(self, node_id: str) -> None:
        link = self.links.pop(node_id)
        loop = asyncio.get_running_loop()
        loop.remove_reader(link.sock.getsockopt(zmq.FD))
        loop.remove_reader(link.monitor.getsockopt(zmq.FD))
        link.sock.disable_monitor()
        link.monitor.close(linger=0)
        link.sock.close(linger=0)
        self.listener.peer_lost(node_id)

    def _watch(self, node_id: str) -> None:
        link = self.links.get(node_id)
        if link is not None:
            drain(link.monitor, partial(self._on_event, link, node_id))

    def _on_event(self, link: Link, node_id: str, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        link.connected = event == zmq.EVENT_HANDSHAKE_SUCCEEDED
        link.refused = link.refused or bool(event & REFUSED)   # a disconnect follows a refusal
        if not link.connected:
            self.listener.peer_lost(node_id)
