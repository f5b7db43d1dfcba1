"""Requests for a context that another node owns, and plain requests while this node is over its
load threshold (cluster/offload.py): sent to that node's front-end, and its replies relayed back to
the caller under the caller's own request id (core.py relays them).

A forwarded request's header carries "hop" (this node's id) and the tenant it was admitted as.
The node receiving it serves it whatever its own view of ownership (two nodes' views may differ
for a heartbeat), so a request travels one hop at most, and Redis's version checks keep the
context consistent whichever node serves it. The receiving node takes the tenant from a
connection it trusts as a cluster peer only (gate.py): with CURVE off every tenant is
self-declared anyway.

The request travels with the front-end's rid as its id, so a reply finds its request by that id.
- Owner unreachable (no complete connection to it: peer_links.py): the request is served here,
  restored from Redis at first use.
- Owner lost with requests there (its connection closed, or silent past the ZMTP heartbeat): each
  is answered UNAVAILABLE, retryable, and not run here: it may have run there already.

Socket-free: `links` (peer_links.py, or a list in tests) sends.
"""
from __future__ import annotations

from typing import Protocol

import msgpack

from mcpd.cluster.offload import PLAIN, Offload
from mcpd.cluster.routing import ContextRouting, context_named
from mcpd.daemon.child_stats import RoutingStats
from mcpd.daemon.messages import OwnerNode
from mcpd.protocol import wire

HOP = "hop"   # the header field marking a forwarded request


class Links(Protocol):
    def sync(self, nodes: dict[str, OwnerNode]) -> None:
        """Keep a connection open to each of these nodes (this one left out), none to others."""

    def send(self, node_id: str, frames: list[bytes]) -> bool:
        """Sends now; False when there is no complete connection to that node (nothing sent)."""

    def connected(self) -> list[str]:
        """The nodes a connection is complete to."""


class Forwarding:
    def __init__(self, node_id: str, links: Links, offload_queued: int):
        self.routing = ContextRouting(node_id)
        self.offload = Offload(node_id, offload_queued)
        self.links = links
        self.away: dict[int, str] = {}   # rid -> the node serving it
        self.counts = dict.fromkeys(("forwarded", "offloaded", "received", "owner_unreachable", "owner_lost"), 0)

    def update(self, nodes: dict[str, OwnerNode], queued: dict[str, int]) -> None:
        self.routing.update(nodes)
        self.links.sync(nodes)
        self.offload.update(nodes, queued)

    def forward(self, rid: int, header: dict, payload: tuple[bytes, ...], tenant: str, args) -> bool:
        """Sends the request to its context's owner when that is another node, or a plain one to a
        less loaded node while this one is over its threshold; False: serve it here."""
        if header.get(HOP) is not None:
            self.counts["received"] += 1
            return False
        context_id = context_named(args)
        if context_id is None:
            return self.offload.target is not None and self._offload(rid, header, payload, tenant, args)
        owner = self.routing.owner_elsewhere(tenant, context_id)
        if owner is None:
            return False
        if not self._send(owner, rid, header, payload, tenant):
            self.counts["owner_unreachable"] += 1
            return False
        self.counts["forwarded"] += 1
        return True

    def _offload(self, rid: int, header: dict, payload: tuple[bytes, ...], tenant: str, args) -> bool:
        """A plain request to the node chosen; no connection to it: served here (the next report may choose another)."""
        target = self.offload.target
        if not isinstance(args, PLAIN) or not self._send(target, rid, header, payload, tenant):
            return False
        self.offload.sent(target)
        self.counts["offloaded"] += 1
        return True

    def _send(self, node_id: str, rid: int, header: dict, payload: tuple[bytes, ...], tenant: str) -> bool:
        hop = {**header, "id": rid, "tenant": tenant, HOP: self.routing.node_id}
        if not self.links.send(node_id, [msgpack.packb(hop), *payload]):
            return False
        self.away[rid] = node_id
        return True

    def reply(self, node_id: str, header_frame: bytes) -> tuple[int, dict, bool] | None:
        """A reply from node `node_id`: (the rid it answers, its header, whether it is the final), or
        None when no request sent there waits for it (a node answers only what it was sent). Raises
        MCPDError for a header that does not decode."""
        header = wire.decode_reply(header_frame)
        rid = header.get("id")
        if type(rid) is not int or self.away.get(rid) != node_id:
            return None
        final = header.get("kind") != "chunk"
        if final:
            del self.away[rid]
        return rid, header, final

    def cancel(self, rid: int) -> bool:
        """Stops a request forwarded elsewhere (its owner is told); False for one served here."""
        node_id = self.away.pop(rid, None)
        if node_id is None:
            return False
        self.links.send(node_id, [wire.encode_request("cancel", f"cancel-{rid}", {"target": rid})])
        return True

    def lost(self, node_id: str) -> list[int]:
        """The node's connection ended: the rids of the requests that were there, forgotten here."""
        rids = [rid for rid, there in self.away.items() if there == node_id]
        for rid in rids:
            del self.away[rid]
        self.counts["owner_lost"] += len(rids)
        return rids

    @staticmethod
    def relabelled(header: dict, request_id: int | str) -> bytes:
        """A peer's reply header, named for the caller's own request id."""
        return msgpack.packb({**header, "id": request_id})

    def stats(self) -> RoutingStats:
        return RoutingStats(owners=sorted(self.routing.nodes), connected=self.links.connected(), away=len(self.away),
                            offloading_to=self.offload.target, **self.counts)
