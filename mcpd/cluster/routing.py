"""Which node serves a request that names a context: its owner among the live nodes (ownership.py).

The front-end decides, not the scheduler: the front-end holds the client's connection and the
request's frames, so a request bound elsewhere leaves from there without crossing to the
scheduler and back. The scheduler's heartbeat thread sees the live nodes; the scheduler hands them
to the front-end as a Members message at each stats report (owner_nodes). A request that names no
context, or a cluster of this node alone, costs one attribute test; one that names a context, a
hash and one numpy pass over the nodes (numpy loads in the front-end only with a cluster).

Socket-free: frontend/forwarding.py sends, frontend/peer_links.py holds the sockets.
"""
from __future__ import annotations

from mcpd.cluster.node_report import NodeReport
from mcpd.cluster.ownership import Ownership, context_hash, serving
from mcpd.daemon.messages import OwnerNode
from mcpd.protocol import args as typed
from mcpd.security.keys import BadKey, check_public_key

MAX_ENDPOINT_CHARS = 256
NAMES_ITS_CONTEXT_BY_ID = (typed.ContextOpenArgs, typed.ContextGetArgs, typed.ContextUpdateArgs, typed.ContextDropArgs)


def context_named(args) -> str | None:
    """The context a request runs on or changes; None for one that names none (it is served here)."""
    if isinstance(args, (typed.GenerateArgs, typed.InferArgs)):
        return args.context
    if isinstance(args, NAMES_ITS_CONTEXT_BY_ID):
        return args.id
    return None


def owner_nodes(reports: dict[str, NodeReport]) -> dict[str, OwnerNode]:
    """The live nodes that may own contexts: those serving a model with a usable weight
    (ownership.serving) and advertising a ZeroMQ endpoint to forward to. Every node applies the
    same rule to the same reports, so all agree on owners. Reports come from Redis, written by
    whoever can write there: each value is checked."""
    owners = {}
    for node_id, weight in serving(reports).items():
        tcp, curve_key = reports[node_id].tcp, _curve_key(reports[node_id].curve_key)
        if tcp.startswith("tcp://") and len(tcp) <= MAX_ENDPOINT_CHARS and curve_key is not None:
            owners[node_id] = OwnerNode(tcp, weight, curve_key)
    return owners


def _curve_key(key: str) -> str | None:
    """A node's advertised CURVE server key: "" for none, None for one that is not a key."""
    if key == "":
        return key
    try:
        return check_public_key(key)
    except BadKey:
        return None


class ContextRouting:
    def __init__(self, node_id: str):
        self.node_id = node_id
        self.nodes: dict[str, OwnerNode] = {}
        self.ownership: Ownership | None = None   # None: no other node to route to

    def update(self, nodes: dict[str, OwnerNode]) -> None:
        if nodes == self.nodes:
            return
        self.nodes = nodes
        others = set(nodes) - {self.node_id}
        self.ownership = Ownership({n: node.weight for n, node in nodes.items()}) if others else None

    def owner_elsewhere(self, tenant: str, context_id: str) -> str | None:
        """The id of the node owning this tenant's context, None when it is this node (or no other is known)."""
        if self.ownership is None:
            return None
        owner = self.ownership.owner(context_hash(tenant, context_id))
        return None if owner == self.node_id else owner
