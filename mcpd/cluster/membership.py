"""The live nodes of a cluster, in Redis: each node registers with a heartbeat carrying its
endpoints, weight, load, free KV and models, and counts as alive until node_ttl_s after its last.

    mcpd:{nodes}          sorted set: node id -> the Redis time (ms) its registration lapses
    mcpd:{nodes}:<id>     hash: the node's last heartbeat (msgpack under "report") and the Redis
                          time (ms) it came ("at"), expiring with it

Redis's own clock stamps every heartbeat (TIME inside the script), so nodes whose clocks differ
still agree on who is alive. The keys share one hash tag: on Redis Cluster the scripts that touch
the set and a node's hash run on one shard.
"""
from __future__ import annotations

import logging

import msgpack
import msgspec
import redis

from mcpd.cluster.node_report import NodeReport

LOG = logging.getLogger("mcpd.cluster")

SET = "mcpd:{nodes}"

# KEYS: the set, the node's hash. ARGV: node id, report, ttl ms.
BEAT = """
local now = redis.call('TIME')
local lapses = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) + tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], lapses, ARGV[1])
redis.call('HSET', KEYS[2], 'report', ARGV[2], 'at', lapses - tonumber(ARGV[3]))
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return lapses
"""

# KEYS: the set. Forgets the lapsed nodes; returns Redis's time (ms), then the ids of the others.
LIVE = """
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms)
local live = redis.call('ZRANGE', KEYS[1], 0, -1)
table.insert(live, 1, ms)
return live
"""

# KEYS: the set, the node's hash. ARGV: node id.
LEAVE = """
redis.call('ZREM', KEYS[1], ARGV[1])
return redis.call('DEL', KEYS[2])
"""


def node_key(node_id: str) -> str:
    return f"{SET}:{node_id}"


class Membership:
    def __init__(self, client: redis.Redis, node_id: str, ttl_s: float, log: logging.Logger = LOG):
        self.redis, self.node_id, self.ttl_ms = client, node_id, max(1, round(ttl_s * 1000))
        self.log = log
        self.left_out: set[str] = set()   # nodes whose report did not decode, logged once
        self.beat_script = client.register_script(BEAT)
        self.live_script = client.register_script(LIVE)
        self.leave_script = client.register_script(LEAVE)

    def beat(self, report: dict) -> None:
        """Register this node (again) with its report; raises one of redis_client.REDIS_ERRORS when
        Redis cannot take it."""
        self.beat_script(keys=[SET, node_key(self.node_id)], args=[self.node_id, msgpack.packb(report), self.ttl_ms])

    def leave(self) -> None:
        self.leave_script(keys=[SET, node_key(self.node_id)], args=[self.node_id])

    def live(self) -> dict[str, NodeReport]:
        """Each live node's last report, by node id, with the age of its heartbeat ("age_ms")."""
        now, *listed = self.live_script(keys=[SET])
        ids = [raw.decode(errors="replace") for raw in listed]
        with self.redis.pipeline(transaction=False) as reading:
            for node_id in ids:
                reading.hmget(node_key(node_id), "report", "at")
            reports = [self._report(node_id, raw, at, now) for node_id, (raw, at) in zip(ids, reading.execute())]
        self.left_out.intersection_update(ids)   # forget the nodes gone
        # A node whose hash lapsed between the two reads is gone: it is left out.
        return {node_id: report for node_id, report in zip(ids, reports) if report is not None}

    def _report(self, node_id: str, raw: bytes | None, at: bytes | None, now: int) -> NodeReport | None:
        """A heartbeat's report and its age; None for none, or for one that does not decode into a
        NodeReport (whoever wrote it: logged once until that node writes a good one). The age is the
        script's own stamp against Redis's clock (_age_ms)."""
        if raw is None:
            return None
        try:
            report = msgspec.msgpack.decode(raw, type=NodeReport)
        except msgspec.DecodeError as e:
            if node_id not in self.left_out:
                self.log.warning("cluster node %r: its heartbeat report is left out (%s)", node_id, e)
            self.left_out.add(node_id)
            return None
        self.left_out.discard(node_id)
        return msgspec.structs.replace(report, age_ms=_age_ms(at, now))


def _age_ms(at: bytes | None, now: int) -> int | None:
    """now - the heartbeat's stamp; None for a stamp that is not a time at or before now (one written by
    someone other than the script; a number past int64 would fail every report that carries it)."""
    stamp = int(at) if at is not None and at.isdigit() and len(at) <= len(str(now)) else None
    return now - stamp if stamp is not None and stamp <= now else None
