"""Where a plain request (a generate or infer naming no context) goes when this node is loaded: to
the least-loaded other node not over cluster.offload_queued, else nowhere (served here).

The choice is made once per stats report (update), when the nodes' queued requests arrive, so that
a request while this node is under the threshold costs one comparison (`target is None`). Between
reports each request sent away counts on its node's load here, so that one quiet node is not sent
a whole report's worth of requests past the threshold.

Socket-free: frontend/forwarding.py sends.
"""
from __future__ import annotations

from mcpd.cluster.node_report import NodeReport
from mcpd.daemon.messages import OwnerNode
from mcpd.protocol import args as typed

PLAIN = (typed.GenerateArgs, typed.InferArgs)
MAX_QUEUED = 1 << 31   # a report's queued count past this is not a load (Redis holds what anyone wrote)


def queued_by_node(reports: dict[str, NodeReport], node_id: str, queued_here: int) -> dict[str, int]:
    """Each live node's queued requests, from its heartbeat's report (a node whose count is not a
    plain count in bounds is left out: never offloaded to), this node's own as counted now."""
    queued = {}
    for other, report in reports.items():
        count = report.queued
        if count is not None and 0 <= count <= MAX_QUEUED:
            queued[other] = count
    queued[node_id] = queued_here
    return queued


class Offload:
    def __init__(self, node_id: str, threshold: int):
        self.node_id = node_id
        self.threshold = threshold   # queued requests over which a node is loaded; 0 = never offload
        self.spare: dict[str, int] = {}   # the other nodes not over it, and their load as counted here
        self.target: str | None = None    # where the next plain request goes; None: served here

    def update(self, nodes: dict[str, OwnerNode], queued: dict[str, int]) -> None:
        """`nodes`: those a request can be sent to; `queued`: the nodes' loads (queued_by_node)."""
        here = queued.get(self.node_id, 0)
        if self.threshold == 0 or here <= self.threshold:
            self.spare = {}
        else:
            self.spare = {node_id: queued[node_id] for node_id in nodes
                          if node_id != self.node_id and queued.get(node_id, MAX_QUEUED) <= self.threshold}
        self._choose()

    def sent(self, node_id: str) -> None:
        """A request went to that node: its load as counted here grows by one."""
        load = self.spare.pop(node_id) + 1
        if load <= self.threshold:
            self.spare[node_id] = load
        self._choose()

    def _choose(self) -> None:
        self.target = min(self.spare, key=lambda node_id: (self.spare[node_id], node_id)) if self.spare else None
