"""The cluster's first figures (docs/CLUSTER.md): ownership balance in-process, and what keeping
contexts in Redis costs a context commit on a real daemon.

    python bench/cluster.py [--quick]

1. Rendezvous ownership (mcpd/cluster/ownership.py) of 1M contexts (--quick: 200k) over 100
   equal nodes: the busiest node's count over the mean (`ownership_balance`), and the fraction of
   contexts that move when one node leaves, times N (`moved_frac_times_n`; 1.0 is ideal).
2. One daemon with [cluster] on (a real redis-server on loopback, AOF fsynced at every write, as
   docs/CLUSTER.md asks) against the same daemon with it off: p50 of one context.update of a
   scalar from one client (`redis_commit_overhead`: on over off), the journal fsynced at every
   commit in both (persistence.fsync = "always", the default). Interleaved rounds.
3. Two nodes and one Redis: p50 of a 1-token generate on a context that node a owns, sent to node b
   (which forwards it to a) over sent to a itself (`forward_p50_ratio`), interleaved, two
   contexts a owns, fresh ones every round so that their history stays short. A turn's commit
   fsyncs the journal and Redis's AOF, which the hop's cost hides in; the same ratio for a
   `context.get`, which commits nothing, shows the hop alone (`forward_get_p50_ratio`).
4. Chaos (chaoskit/chaos_run.py): three nodes on one Redis, 16 cluster-aware clients chatting on
   64 contexts; a node SIGKILLed and restarted every 20 s (--quick: 2 kills), Redis SIGKILLed and
   restarted once: acknowledged turns lost, turns unanswered, turns answered otherwise than one
   uninterrupted node answers, kill to a moved context's next answer, turns/s around the kills.
Last line JSON with the figures.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from contextlib import ExitStack

import numpy as np

from chaoskit import chaos_run

from mcpd.cluster.ownership import Ownership, context_hash
from mcpd.testing import Daemon, RedisServer, contexts_owned_by, forwarding_node, wait_linked

NODES = [f"node-{i}" for i in range(100)]


def ownership(contexts: int) -> dict:
    keys = np.array([context_hash("tenant", f"ctx-{i}") for i in range(contexts)], np.uint64)
    before = Ownership(dict.fromkeys(NODES, 1.0))
    was = before.owners(keys)
    counts = np.bincount(was, minlength=len(NODES))
    after = Ownership({n: 1.0 for n in NODES if n != "node-42"})
    now = np.array([before.nodes.index(n) for n in after.nodes])[after.owners(keys)]
    return {"contexts": contexts, "nodes": len(NODES), "ownership_balance": round(float(counts.max() / counts.mean()), 4),
            "moved_frac_times_n": round(float((was != now).mean() * len(NODES)), 4)}


def commit_times(daemon: Daemon, context_id: str, commits: int) -> list[float]:
    times = []
    with daemon.client(tenant="bench") as client:
        ctx = client.context(context_id)
        for n in range(commits):
            ctx["n"] = n
            started = time.perf_counter()
            ctx.sync()
            times.append(time.perf_counter() - started)
    return times


def commit_overhead(rounds: int, commits: int) -> dict:
    redis = RedisServer().start()
    plain, clustered = Daemon(), Daemon(cluster={"redis": redis.url, "node_id": "bench"})
    try:
        plain.start()
        clustered.start()
        off, on = [], []
        for r in range(rounds):
            off += commit_times(plain, f"c{r}", commits)
            on += commit_times(clustered, f"c{r}", commits)
    finally:
        for daemon in (plain, clustered):
            daemon.stop()
            daemon.cleanup()
        redis.cleanup()
    off_p50, on_p50 = statistics.median(off), statistics.median(on)
    return {"commits": len(on), "commit_p50_ms_off": round(off_p50 * 1e3, 3), "commit_p50_ms_on": round(on_p50 * 1e3, 3),
            "redis_commit_overhead": round(on_p50 / off_p50, 3)}


def turn_times(daemon: Daemon, context_id: str, turns: int) -> tuple[list[float], list[float]]:
    """The times of `turns` 1-token generates on the context, and of a context.get after each."""
    generates, gets = [], []
    with daemon.client(tenant="bench") as client:
        client.call("context.open", {"id": context_id})
        for _ in range(turns):
            started = time.perf_counter()
            client.generate("hi", context=context_id, max_tokens=1, temperature=0)
            generated = time.perf_counter()
            client.call("context.get", {"id": context_id, "since": 0})
            generates.append(generated - started)
            gets.append(time.perf_counter() - generated)
    return generates, gets


def forward_cost(rounds: int, turns: int) -> dict:
    with ExitStack() as teardown:   # LIFO: each node stops before its directory goes, Redis last
        redis = RedisServer().start()
        teardown.callback(redis.cleanup)
        nodes = [forwarding_node(Daemon, redis.url, name) for name in ("a", "b")]
        for node in nodes:
            teardown.callback(node.cleanup)
            teardown.callback(node.stop)
        wait_linked([node.start() for node in nodes])
        ids = iter(contexts_owned_by("a", ["a", "b"], "bench", 2 * rounds))
        times = {(node.node_id, op): [] for node in nodes for op in ("turn", "get")}   # a: the owner; b forwards to a
        for _, node in itertools.product(range(rounds), nodes):
            generates, gets = turn_times(node, next(ids), turns)
            times[node.node_id, "turn"] += generates
            times[node.node_id, "get"] += gets
    p50 = {key: statistics.median(values) for key, values in times.items()}
    return {"turns": len(times["a", "turn"]), "turn_p50_ms_owner": round(p50["a", "turn"] * 1e3, 3),
            "turn_p50_ms_forwarded": round(p50["b", "turn"] * 1e3, 3),
            "forward_p50_ratio": round(p50["b", "turn"] / p50["a", "turn"], 3),
            "get_p50_ms_owner": round(p50["a", "get"] * 1e3, 3), "get_p50_ms_forwarded": round(p50["b", "get"] * 1e3, 3),
            "forward_get_p50_ratio": round(p50["b", "get"] / p50["a", "get"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    quick = parser.parse_args().quick
    figures = {**ownership(200_000 if quick else 1_000_000), **commit_overhead(3 if quick else 10, 100 if quick else 300),
               **forward_cost(3 if quick else 10, 50 if quick else 100), **chaos_run.run(quick)}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
