"""The chaos run: 16 clients chat on 64 contexts (each context one client's) across three nodes
while a node is SIGKILLed and restarted every 20 s, and Redis once; then every context is read
back and its turns replayed on a fresh single node.

Figures: `lost_acked_updates` (an acknowledged turn missing from its context afterwards),
`unanswered` (a turn given up after GIVE_UP_S of retries), `wrong_version_answers` (a turn whose
tokens differ from what one uninterrupted node answers to the same history, greedy),
`failover_first_token_s_max`/`_p50` (a node's kill to the next answer on each context it owned:
turns are 4 tokens, so the answer is the first token's upper bound), and turns/s before, during
and after the kills. The nodes run the default model (the embedded one, a token a byte).
"""
from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from chaoskit.chat_client import TENANT, TURN, ChatClient, ChatContext
from chaoskit.cluster_view import ClusterView
from chaoskit.nodes import ChaosCluster
from mcpd.testing import Daemon

NODES, CLIENTS, CONTEXTS = 3, 16, 64
REDIS_DOWN_S = 2.0
# A node's restart loads its model on the cores the other two nodes run on here (separate machines
# would not share them), stalling every turn for seconds: it comes once the failover is over.
RESTART_AFTER_S = 5.0
REDIS = "redis"


@dataclass
class Plan:
    warm_s: float          # chatting before the first kill
    node_kills: int        # one every kill_every_s, the nodes in turn
    kill_every_s: float
    redis_kill_at_s: float  # after the first node's kill
    after_s: float         # chatting once the last node is back

    @property
    def chaos_s(self) -> float:
        return self.node_kills * self.kill_every_s


QUICK = Plan(warm_s=10, node_kills=2, kill_every_s=20, redis_kill_at_s=30, after_s=15)
FULL = Plan(warm_s=20, node_kills=5, kill_every_s=20, redis_kill_at_s=50, after_s=30)


@dataclass
class Kill:
    at: float
    node: str
    owned: set[str]   # the contexts it owned as it died
    back: float = 0.0  # when its restart was ready


def run(quick: bool) -> dict:
    plan = QUICK if quick else FULL
    cluster = ChaosCluster(NODES).start()
    view = ClusterView(cluster.redis.url, cluster.endpoints).start()
    try:
        view.wait_for(set(cluster.daemons))
        ids = [f"ctx-{i}" for i in range(CONTEXTS)]
        clients = [ChatClient(view, ids[i::CLIENTS]) for i in range(CLIENTS)]
        for client in clients:
            client.open_all()
        started = time.monotonic()
        for client in clients:
            client.start()
        kills, chaos_end = _chaos(cluster, view, plan, [c for client in clients for c in client.contexts], started)
        view.wait_for(set(cluster.daemons))
        time.sleep(plan.after_s)
        ended = time.monotonic()
        for client in clients:
            client.stop()
        finals = {c.id: client.read(c) for client in clients for c in client.contexts}
        for client in clients:
            client.close()
    finally:
        view.close()
        cluster.close()
    contexts = [c for client in clients for c in client.contexts]
    print(f"{ended - started:6.1f} s: chatting stopped; replaying {sum(len(c.turns) for c in contexts)} turns "
          "on a fresh node", flush=True)
    return {**_outcomes(contexts, finals), **_failover(contexts, kills),
            **_throughput(contexts, started, started + plan.warm_s, chaos_end, ended),
            "wrong_version_answers": _replay_wrong(contexts)}


def _chaos(cluster: ChaosCluster, view: ClusterView, plan: Plan, contexts: list[ChatContext],
           started: float) -> tuple[list[Kill], float]:
    """The kills, each at its time from `started` or once the one before is done; returns the
    nodes' kills and when the last was back."""
    nodes = sorted(cluster.daemons)
    events = [(plan.warm_s + k * plan.kill_every_s, nodes[k % len(nodes)]) for k in range(plan.node_kills)]
    events = sorted(events + [(plan.warm_s + plan.redis_kill_at_s, REDIS)])
    kills = []
    for at, target in events:
        _sleep_until(started + at)
        if target == REDIS:
            _kill_redis(cluster, started)
        else:
            kills.append(_kill_node(cluster, view, target, contexts, started))
    _sleep_until(started + plan.warm_s + plan.chaos_s)
    return kills, time.monotonic()


def _kill_node(cluster: ChaosCluster, view: ClusterView, node: str, contexts: list[ChatContext],
               started: float) -> Kill:
    kill = Kill(time.monotonic(), node, {c.id for c in contexts if view.owner(TENANT, c.id) == node})
    cluster.kill(node)
    time.sleep(RESTART_AFTER_S)
    cluster.restart(node)
    kill.back = time.monotonic()
    print(f"{kill.at - started:6.1f} s: {node} SIGKILLed, owning {len(kill.owned)} contexts; "
          f"back after {kill.back - kill.at:.1f} s", flush=True)
    return kill


def _kill_redis(cluster: ChaosCluster, started: float) -> None:
    at = time.monotonic()
    cluster.redis.kill()
    time.sleep(REDIS_DOWN_S)
    cluster.redis.start()
    print(f"{at - started:6.1f} s: Redis SIGKILLed, restarted {REDIS_DOWN_S:g} s later", flush=True)


def _outcomes(contexts: list[ChatContext], finals: dict[str, tuple[int, list[int]]]) -> dict:
    lost = 0
    for context in contexts:
        version, tokens = finals[context.id]
        offset = 0
        for turn in context.turns:
            kept = version >= turn.version and tokens[offset:offset + len(turn.tokens)] == turn.tokens
            lost += turn.acked and not kept
            offset += len(turn.tokens)
    turns = [t for c in contexts for t in c.turns]
    refusals: dict[str, int] = {}
    for context in contexts:
        for code, n in context.refusals.items():
            refusals[code] = refusals.get(code, 0) + n
    return {"turns_acked": sum(t.acked for t in turns), "turns_recovered": sum(not t.acked for t in turns),
            "lost_acked_updates": lost, "unanswered": sum(c.unanswered for c in contexts),
            "refused": refusals, "retries": sum(c.retries for c in contexts),
            "contexts_full": sum(c.full for c in contexts)}


def _failover(contexts: list[ChatContext], kills: list[Kill]) -> dict:
    """Each killed node's contexts: from the kill (or the turn's start, if later) to their next answer."""
    waits = []
    by_id = {c.id: c for c in contexts}
    for kill in kills:
        for cid in kill.owned:
            after = [t for t in by_id[cid].turns if t.answered > kill.at]
            if after:
                waits.append(after[0].answered - max(kill.at, after[0].started))
    return {"kill_to_back_s_max": round(max(k.back - k.at for k in kills), 2),
            "failover_first_token_s_max": round(max(waits), 3) if waits else None,
            "failover_first_token_s_p50": round(statistics.median(waits), 3) if waits else None,
            "failover_contexts": len(waits)}


def _throughput(contexts: list[ChatContext], started: float, chaos_start: float, chaos_end: float,
                ended: float) -> dict:
    answered = [t.answered for c in contexts for t in c.turns]

    def rate(begin: float, end: float) -> float:
        return round(sum(begin <= a < end for a in answered) / (end - begin), 2)
    return {"turns_per_s_before": rate(started, chaos_start), "turns_per_s_during": rate(chaos_start, chaos_end),
            "turns_per_s_after": rate(chaos_end, ended)}


def _replay_wrong(contexts: list[ChatContext]) -> int:
    """Every context's turns again, in order, on a fresh single node: the turns answered otherwise."""
    daemon = Daemon().start()
    try:
        with ThreadPoolExecutor(8) as pool:
            return sum(pool.map(lambda part: _replay(daemon, part), [contexts[i::8] for i in range(8)]))
    finally:
        daemon.stop()
        daemon.cleanup()


def _replay(daemon: Daemon, contexts: list[ChatContext]) -> int:
    wrong = 0
    with daemon.client(tenant=TENANT, timeout=120) as client:
        for context in contexts:
            client.call("context.open", {"id": context.id})
            for turn in context.turns:
                again = client.generate(turn.prompt, context=context.id, **TURN).context.appended_token_ids
                wrong += list(again) != turn.tokens
    return wrong


def _sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))
