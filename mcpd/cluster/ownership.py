"""Which live node owns a context: weighted rendezvous (highest random weight) hashing.

Every node scores every context, score = weight / -ln(u) with u a uniform draw in (0, 1) made from
the node's and the context's hashes, and the highest score owns it. The share of contexts a node
owns is its weight over the sum (capacity-weighted), and a node that leaves moves only the
contexts it owned: every other context keeps the node that scored highest for it. No ring, no
virtual nodes, and every node computes the same owner from the same list of live nodes.

Socket-free: the live nodes and their weights come from the membership records in Redis.
"""
from __future__ import annotations

import hashlib
import math

import msgpack
import numpy as np

from mcpd.cluster.node_report import NodeReport

_MASK = (1 << 64) - 1


def context_hash(owner: str, context_id: str) -> int:
    """A context's 64-bit hash (the tenant in it: two tenants' contexts of one id are two contexts)."""
    return _digest(msgpack.packb([owner, context_id]), b"mcpd-owner-ctx")


def node_hash(node_id: str) -> int:
    return _digest(node_id.encode(), b"mcpd-owner-node")


def weights(reports: dict[str, NodeReport]) -> dict[str, float]:
    """Each live node's weight, as its last heartbeat (by id) says; a node whose weight is not a
    positive finite number (whoever wrote it) owns nothing."""
    return {node_id: report.weight for node_id, report in reports.items() if 0 < report.weight < math.inf}


def serving(reports: dict[str, NodeReport]) -> dict[str, float]:
    """The nodes a client's requests go to by ownership, with their weights: those of `weights`
    whose heartbeat names a model they serve. A node still loading its models owns nothing yet:
    a context moved to it would wait out the load."""
    return {node_id: weight for node_id, weight in weights(reports).items() if reports[node_id].models}


class Ownership:
    def __init__(self, weights: dict[str, float]):
        """`weights`: each live node's capacity (> 0), by node id."""
        if not weights or min(weights.values()) <= 0:
            raise ValueError("ownership needs at least one node, each of weight > 0")
        self.nodes = sorted(weights)   # a fixed order: equal scores (never seen) break the same way everywhere
        self.seeds = np.array([node_hash(n) for n in self.nodes], np.uint64)
        self.weights = np.array([weights[n] for n in self.nodes], np.float64)
        self.scored = [(n, node_hash(n), float(weights[n])) for n in self.nodes]

    def owner(self, key: int) -> str:
        """The node owning the context of hash `key` (context_hash). Plain Python, the same
        arithmetic as owners(): the front-end asks per request, and on arrays of a few nodes
        numpy's per-call cost, many calls a score, outweighs the arithmetic."""
        best, owner = -math.inf, self.nodes[0]
        for node, seed, weight in self.scored:
            score = weight / -math.log(_uniform_one(seed ^ key))
            if score > best:   # the first of equal scores wins, as argmax's does
                best, owner = score, node
        return owner

    def owners(self, keys: np.ndarray) -> np.ndarray:
        """The owners of many contexts at once (uint64 hashes), as indices into self.nodes."""
        best = np.full(len(keys), -np.inf)
        owner = np.zeros(len(keys), np.int64)
        for index, (seed, weight) in enumerate(zip(self.seeds, self.weights)):
            score = weight / -np.log(_uniform(keys ^ seed))
            better = score > best
            best[better], owner[better] = score[better], index
        return owner


def _uniform(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64s, then the top 53 bits as a float strictly inside (0, 1)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def _uniform_one(x: int) -> float:
    """_uniform for one uint64, in Python integers (masked to 64 bits as numpy's wrap)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    x ^= x >> 31
    return ((x >> 11) + 0.5) / float(1 << 53)


def _digest(data: bytes, person: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=person).digest(), "little") & _MASK
