"""Red team: every attack the daemon must hold (hostile tenants and input, damaged disks, kills,
careless operators), against the real daemon on loopback, each bounded in time.

    python bench/redteam.py [--quick] [--only NAME ...]

Each attack is one small function `attack_<name>(run) -> Outcome`: it plays a hostile tenant, a
careless operator or a damaged disk, and says whether the daemon's promise held (every request
gets one final reply; an acknowledged context update is never lost; a tenant sees and affects only
its own work; bad input gets a clear error while the daemon and everyone else carry on), with its
figures: resident memory, restarts, lost finals, lost acknowledged updates. An attack that raises
or runs past its time limit counts as broken. Several attacks share one daemon (`run.shared()`);
the others start their own.

--quick runs the attacks on the shared daemon at smaller sizes (under a minute); the rest are
listed as skipped. The last line is JSON: `broken` (attacks that did not hold), `lost` (finals
and acknowledged updates lost, over all attacks), `skipped`, and per attack its figures.
Baseline: this is a pass/fail audit, not a speed figure; each attack's figure is judged against
what the daemon promises (e.g. memory against the configured limits).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import psutil
import zmq

from mcpd.client import Client, CurveKeys
from mcpd.daemon.frontend.gate import CLIENT_IPC_MODE
from mcpd.memory.host_segment import segment_path
from mcpd.percentile import percentile
from mcpd.protocol import codes, wire
from mcpd.protocol.codes import MCPDError
from mcpd.raw_zmtp import RawPeer, at_lowest_priority
from mcpd.security.keys import generate, read_public
from mcpd.sockets import client_endpoint
from mcpd.testing import STORM_CONFIG, Daemon, SteadyLoad, free_port, version_storm

MiB = 1 << 20
ATTACK_LIMIT_S = 180
SHARED_LIMITS = {"max_message_bytes": 8 * MiB, "max_incoming_bytes": 32 * MiB}
SHARED_HTTP = {"max_body_bytes": MiB, "body_timeout_s": 2.0, "keepalive_timeout_s": 5.0}


@dataclass
class Outcome:
    held: bool
    figures: dict = field(default_factory=dict)
    lost_finals: int = 0
    lost_updates: int = 0


class Run:
    """What attacks share: the --quick flag, one daemon for the attacks that do not harm it, and
    the daemons each attack starts (stopped after it)."""

    def __init__(self, quick: bool):
        self.quick = quick
        self._shared: Daemon | None = None
        self.started: list[Daemon] = []

    def shared(self) -> Daemon:
        if self._shared is None:
            self._shared = Daemon(limits=SHARED_LIMITS, http={"listen": f"127.0.0.1:{free_port()}", **SHARED_HTTP}).start()
        return self._shared

    def daemon(self, wait: bool = True, **sections) -> Daemon:
        d = Daemon(**sections)
        self.started.append(d)
        return d.start(wait=wait)

    def stop_own(self) -> None:
        for d in self.started:
            stop(d)
        self.started = []

    def stop_all(self) -> None:
        self.stop_own()
        if self._shared is not None:
            stop(self._shared)


def stop(d: Daemon) -> None:
    try:
        if d.process is not None:
            d.stop()
    finally:
        d.cleanup()


# -- helpers --------------------------------------------------------------------------------------

def restarts(d: Daemon, role: str) -> int:
    return sum(p["restarts"] for p in d.processes() if p["role"] == role)


def raw_socket(d: Daemon, routing_id: bytes | None = None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.connect(d.endpoint)
    return sock


def exchange(sock: zmq.Socket, frames: list[bytes], timeout_s: float = 10) -> dict | None:
    sock.send_multipart(frames)
    if not sock.poll(timeout_s * 1000):
        return None
    reply = sock.recv_multipart()
    return wire.decode_reply(reply[-1] if reply[0] == b"" else reply[0])   # [b"", header]: REQ's delimiter echoed


def header(op: str = "ping", **fields) -> bytes:
    return msgpack.packb({"v": 1, "op": op, "id": 1, **fields})


class PeakMemory:
    """A process's peak resident size from now on (VmHWM, reset here through clear_refs)."""

    def __init__(self, pid: int):
        self.pid = pid
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        self.start = self._kib("VmRSS")

    def growth_mib(self) -> float:
        return round((self._kib("VmHWM") - self.start) / 1024, 1)

    def _kib(self, name: str) -> int:
        line = next(x for x in Path(f"/proc/{self.pid}/status").read_text().splitlines() if x.startswith(name))
        return int(line.split()[1])


def final_code(client: Client, request_id, timeout: float = 60) -> str:
    try:
        while (reply := client.receive(request_id, timeout))["kind"] == "chunk":
            pass
    except MCPDError as e:
        return e.code
    return reply.get("code", "ok")


def context_versions(client: Client, ids: list[str]) -> dict[str, int]:
    """Each context's version as the daemon has it now (-1: gone)."""
    found = {}
    for context_id in ids:
        try:
            found[context_id] = client.call("context.open", {"id": context_id, "create": False})["version"]
        except MCPDError:
            found[context_id] = -1
    return found


def lost_versions(acked: dict[str, int], restored: dict[str, int], allowed_contexts: int = 0) -> int:
    """Acknowledged versions missing, leaving out the `allowed_contexts` most hurt contexts."""
    losses = sorted((acked[c] - restored.get(c, -1) for c in acked), reverse=True)
    return sum(loss for loss in losses[allowed_contexts:] if loss > 0)


def commit_versions(client: Client, contexts: int, versions: int) -> dict[str, int]:
    """`contexts` contexts with `versions` scalar commits each, interleaved; their acknowledged versions."""
    mirrors = {f"c{i}": client.context(f"c{i}") for i in range(contexts)}
    for v in range(versions):
        for mirror in mirrors.values():
            mirror["n"] = v
            mirror.sync()
    return {name: mirror.version for name, mirror in mirrors.items()}


def flip_bit(path: Path, fraction: float) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * fraction)] ^= 0x10
    path.write_bytes(bytes(data))


def outcome_of_start(d: Daemon, watch_s: float) -> dict:
    """Watch a daemon start: ready, exited (with its code), or neither (e.g. a restart loop)."""
    deadline = time.monotonic() + watch_s
    while time.monotonic() < deadline:
        if d.process.poll() is not None:
            return {"state": "exited", "exit_code": d.process.returncode}
        d.drain_notifications()
        if "READY=1" in d.notifications:
            return {"state": "ready"}
        time.sleep(0.2)
    return {"state": "neither ready nor exited", "scheduler_restarts": restarts(d, "scheduler"),
            "frontend_restarts": restarts(d, "frontend")}


class SlowClient:
    """A DEALER that reads nothing until asked, with the smallest queue it can ask for, on the ipc
    endpoint (Unix sockets buffer a fixed ~200 KB; over loopback TCP the kernel takes megabytes
    first, and a receive buffer small enough to prevent that stalls TCP itself)."""

    def __init__(self, d: Daemon):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        self.sock.connect(client_endpoint(d.runtime_dir))
        self.waiting: set[int] = set()
        self.sent = 0

    def send(self, op: str, args: dict) -> int:
        request_id, self.sent = self.sent, self.sent + 1
        self.waiting.add(request_id)
        self.sock.send(wire.encode_request(op, request_id, args))
        return request_id

    def read_finals(self, idle_s: float = 10) -> Counter:
        """Read until every request has its final, or nothing came for idle_s; codes of finals."""
        finals = Counter()
        while self.waiting and self.sock.poll(idle_s * 1000):
            reply = wire.decode_reply(self.sock.recv_multipart()[0])
            if reply["kind"] != "chunk" and reply["id"] in self.waiting:
                self.waiting.discard(reply["id"])
                finals[reply.get("code", "ok")] += 1
        return finals


# -- hostile tenants and operators: broken once --------------------------------------------------

def attack_poison_request(run: Run) -> Outcome:
    """generate with top_k = 2^63 (and other out-of-range integers) once a second while another
    client works: no worker may die, and the other client must see no error."""
    d = run.shared()
    before = restarts(d, "worker")
    stop_load, benign = threading.Event(), Counter()

    def load():
        with d.client(timeout=60) as client:
            while not stop_load.is_set():
                try:
                    client.generate("benign", max_tokens=4, ignore_eos=True)
                    benign["ok"] += 1
                except MCPDError as e:
                    benign[e.code] += 1

    thread = threading.Thread(target=load)
    thread.start()
    poisons = [{"top_k": 1 << 63}, {"seed": (1 << 64) - 1}, {"top_k": 1 << 62}]
    replies = Counter()
    with d.client(timeout=60) as client:
        for i in range(3 if run.quick else 10):
            try:
                client.generate("poison", max_tokens=4, temperature=1.0, **poisons[i % len(poisons)])
                replies["ok"] += 1
            except MCPDError as e:
                replies[e.code] += 1
            time.sleep(1.0)
    stop_load.set()
    thread.join(60)
    died = restarts(d, "worker") - before
    failed = sum(n for code, n in benign.items() if code != "ok")
    return Outcome(died == 0 and failed == 0,
                   {"worker_restarts": died, "poison_replies": dict(replies), "benign": dict(benign)},
                   lost_finals=benign[codes.TIMEOUT])


def attack_cache_filling(run: Run) -> Outcome:
    """One tenant makes many contexts with one scalar commit each; another tenant must still open,
    update and run a turn."""
    d = run.daemon(cache={"bytes": 16 * MiB})
    made, hog_refused = 0, None
    with d.client(tenant="hog", timeout=30) as hog:
        for i in range(2048):
            try:
                mirror = hog.context(f"h{i}")
                mirror["x"] = i
                mirror.sync()
                made += 1
            except MCPDError as e:
                hog_refused = e.code
                break
    with d.client(tenant="victim", timeout=30) as client:
        victim = victim_steps(client)
    cache = d.status()["cache"]
    return Outcome(all(v == "ok" for v in victim.values()),
                   {"hog_contexts": made, "hog_refused": hog_refused, "victim": victim,
                    "cache_used_mib": round(cache.get("used_bytes", 0) / MiB, 1)})


def victim_steps(client: Client) -> dict[str, str]:
    """Another tenant's everyday work: open a context, update it, run a chat turn on one."""
    def update():
        mirror = client.context("mine")
        mirror["x"] = 1
        mirror.sync()

    done = {}
    for step, action in (("open", lambda: client.context("mine")), ("update", update),
                         ("turn", lambda: client.context("chat").chat("user", "hi", max_tokens=2))):
        try:
            action()
            done[step] = "ok"
        except MCPDError as e:
            done[step] = e.code
    return done


def attack_damaged_journal(run: Run) -> Outcome:
    """One flipped bit in record ~12 of ~124: at most that context's later versions may go."""
    d = run.daemon()
    with d.client() as client:
        acked = commit_versions(client, contexts=4, versions=31)
    d.stop()
    journal = next((d.root / "state/contexts").glob("journal-*.log"))
    flip_bit(journal, 0.1)
    d.start()
    with d.client() as client:
        restored = context_versions(client, list(acked))
    lost = lost_versions(acked, restored, allowed_contexts=1)
    return Outcome(lost == 0, {"acked": acked, "restored": restored,
                               "damaged_bytes_kept": any(p != journal for p in (d.root / "state").rglob("*journal*"))},
                   lost_updates=lost)


def attack_damaged_snapshot(run: Run) -> Outcome:
    """A flipped bit in the snapshot (written at compaction): at most one context may lose versions."""
    d = run.daemon(persistence={"compact_after_bytes": 4096})
    with d.client() as client:
        acked = commit_versions(client, contexts=4, versions=20)
    d.stop()
    snapshot = d.root / "state/contexts/snapshot"
    if not snapshot.exists():
        return Outcome(False, {"error": "no snapshot was written"})
    flip_bit(snapshot, 0.5)
    d.start()
    with d.client() as client:
        restored = context_versions(client, list(acked))
    lost = lost_versions(acked, restored, allowed_contexts=1)
    return Outcome(lost == 0, {"acked": acked, "restored": restored}, lost_updates=lost)


def attack_journal_is_a_directory(run: Run) -> Outcome:
    """A journal path that is a directory: start with a clear log line, never a restart loop."""
    d = Daemon()
    run.started.append(d)
    (d.root / "state/contexts/journal-0.log").mkdir(parents=True)
    d.start(wait=False)
    seen = outcome_of_start(d, 20)
    held = seen["state"] == "ready" and restarts(d, "scheduler") == 0 or \
        seen["state"] == "exited" and seen["exit_code"] != 0 and "journal" in d.log()
    return Outcome(held, seen)


def attack_journal_over_field_limit(run: Run) -> Outcome:
    """A journal written under a larger contexts.max_field_bytes than the config now allows."""
    d = run.daemon(contexts={"max_field_bytes": 2 * MiB})
    with d.client() as client:
        mirror = client.context("big")
        mirror["blob"] = bytes(int(1.5 * MiB))
        mirror.sync()
    d.stop()
    d.config_path.write_text(d.config_path.read_text().replace(f"max_field_bytes = {2 * MiB}", f"max_field_bytes = {MiB}"))
    d.start(wait=False)
    seen = outcome_of_start(d, 30)
    if seen["state"] == "ready":
        time.sleep(3)
        seen["scheduler_restarts"] = restarts(d, "scheduler")
    held = seen["state"] == "ready" and seen["scheduler_restarts"] == 0
    return Outcome(held, seen)


def curve_daemon(run: Run) -> Daemon:
    return run.daemon(security={"curve": "on"}, limits={"max_new_tokens": 4})


def key_pair(d: Daemon, name: str) -> CurveKeys:
    public, secret = generate(d.root / "clients", name)
    return CurveKeys(read_public(d.root / "state/keys/server.key"), public, secret)


def served(client: Client) -> str:
    try:
        client.ping(timeout=3)
        return "served"
    except MCPDError as e:
        return e.code


def attack_curve_identity(run: Run) -> Outcome:
    """After `keys allow bob <new key>`, and after revoke and re-allow with another key, bob's old
    key's open connection must not be served any more."""
    d = curve_daemon(run)
    with d.client(curve=d.curve_keys("bob")) as old:
        first = served(old)
        d.mcpctl("keys", "allow", "--", "bob", key_pair(d, "bob2").public)
        time.sleep(1.5)   # keys are re-read within half a second
        after_replace = served(old)
        d.mcpctl("keys", "revoke", "bob")
        d.mcpctl("keys", "allow", "--", "bob", key_pair(d, "bob3").public)
        time.sleep(1.5)
        after_reallow = served(old)
    figures = {"before": first, "after_replace": after_replace, "after_revoke_and_reallow": after_reallow}
    return Outcome(first == "served" and after_replace != "served" and after_reallow != "served", figures)


def attack_undecodable_key(run: Run) -> Outcome:
    """`keys allow x <forty #>`: refused, or at least every other CURVE tenant still served."""
    d = curve_daemon(run)
    alice_keys = d.curve_keys("alice")
    allowed = d.mcpctl("keys", "allow", "--", "x", "#" * 40)
    time.sleep(1.5)
    with d.client(curve=alice_keys) as alice:
        alice_now = served(alice)
    with d.client(curve=d.curve_keys("carol")) as carol:
        new_handshake = served(carol)
    figures = {"allow_exit_code": allowed.returncode, "existing_tenant": alice_now, "new_tenant": new_handshake}
    return Outcome(alice_now == "served" and new_handshake == "served", figures)


def attack_umask_000(run: Run) -> Outcome:
    """Started under umask 000: nothing the daemon creates may be world-writable, except the one
    endpoint meant for every local user: with CURVE on, client.ipc (0666), where the tenant is
    the peer's uid taken from the kernel, not anything the peer says."""
    previous = os.umask(0)
    try:
        d = run.daemon(security={"curve": "on"})
    finally:
        os.umask(previous)
    public = d.runtime_dir / "client.ipc"
    writable = [str(p.relative_to(d.root)) for top in (d.runtime_dir, d.root / "state")
                for p in [top, *top.rglob("*")] if p.exists() and p.lstat().st_mode & 0o002 and p != public]
    public_mode = oct(public.lstat().st_mode & 0o777)
    return Outcome(not writable and public_mode == oct(CLIENT_IPC_MODE),
                   {"world_writable": writable, "client_ipc_mode": public_mode})


def attack_planted_runtime_dir(run: Run) -> Outcome:
    """A runtime dir another user owns and can write, with mcpd.lock a symlink to a victim file."""
    d = Daemon()
    run.started.append(d)
    d.runtime_dir.mkdir(mode=0o777)
    os.chmod(d.runtime_dir, 0o777)
    victim = d.root / "victim"
    victim.write_text("precious")
    (d.runtime_dir / "mcpd.lock").symlink_to(victim)
    os.chown(d.runtime_dir, 65534, 65534)   # nobody's (the benchmark runs as root or owns it)
    d.start(wait=False)
    seen = outcome_of_start(d, 20)
    intact = victim.read_text() == "precious"
    held = intact and (seen["state"] == "exited" and seen["exit_code"] != 0)
    return Outcome(held, {**seen, "victim_intact": intact})


def attack_shared_state_dir(run: Run) -> Outcome:
    """Two daemons with their own runtime dirs but one state dir: the second must refuse to start."""
    first = run.daemon()
    second = Daemon(server={"state_dir": str(first.root / "state")})
    run.started.append(second)
    second.start(wait=False)
    seen = outcome_of_start(second, 20)
    return Outcome(seen["state"] == "exited" and seen["exit_code"] != 0, seen)


# -- hostile tenants and operators: degraded once ------------------------------------------------

def attack_slow_consumer(run: Run) -> Outcome:
    """A client that stops reading while streams run and thousands of replies pile up: when it
    reads again, every request must have its final."""
    d = run.shared()
    slow = SlowClient(d)
    with d.client() as pacer:
        for _ in range(5 if run.quick else 20):   # rounds that fill ZeroMQ's queue, the kernel's, then more
            for _ in range(2000):
                slow.send("ping", {})
            d.wait_until(lambda: pacer.status()["inflight"] == 0, 60, "the round answered")
    for i in range(5 if run.quick else 30):
        slow.send("generate", {"prompt": f"s{i}", "max_tokens": 40 if run.quick else 200, "ignore_eos": True,
                               "stream": True})
    d.wait_until(lambda: d.status()["queue"]["inflight"] == 0, 120, "every request answered")
    backlog = d.status()["requests"].get("backlog", {})
    finals = slow.read_finals()
    lost = len(slow.waiting)
    slow.sock.close()
    return Outcome(lost == 0, {"requests": slow.sent, "finals": dict(finals), "lost_finals": lost,
                               "backlog_while_stalled": backlog}, lost_finals=lost)


def attack_priority_inversion(run: Run) -> Outcome:
    """The queue full of low requests: critical requests must all be admitted (displacing lows)."""
    d = Daemon(scheduler={"max_inflight_per_worker": 1, "max_queue": 16}, engine={"max_num_seqs": 1})
    run.started.append(d)
    d.start()
    with d.client() as client:
        blocker = client.send("generate", {"prompt": "block", "max_tokens": 2000, "ignore_eos": True,
                                           "stream": True}, priority="critical")
        client.receive(blocker)
        lows = [client.send("generate", {"prompt": f"low {i}", "max_tokens": 2}, priority="low") for i in range(16)]
        d.wait_until(lambda: client.status()["queue_depth"] == 16, 30, "the queue full")
        criticals = [client.send("generate", {"prompt": f"crit {i}", "max_tokens": 2}, priority="critical")
                     for i in range(8)]
        time.sleep(1.0)
        client.cancel(blocker)
        final_code(client, blocker)
        critical_codes = Counter(final_code(client, rid) for rid in criticals)
        low_codes = Counter(final_code(client, rid) for rid in lows)
    refused = sum(n for code, n in critical_codes.items() if code != "ok")
    return Outcome(refused == 0, {"critical": dict(critical_codes), "low": dict(low_codes)})


def attack_noisy_neighbour(run: Run) -> Outcome:
    """Tenant a holds a worker's 64 slots and more waiting with long generates in the default
    class; tenant b's 1-token p99 under that flood must stay within 2x its idle p99
    (`noisy_neighbour`), and no request of either may lose its final."""
    d = run.daemon(engine={"pool_bytes": 512 * MiB})
    victims = 30 if run.quick else 200
    with d.client(tenant="a") as a, d.client(tenant="b") as b:
        b.generate("warm up", max_tokens=1)
        idle = victim_latencies(b, victims)
        flood = [a.send("generate", {"prompt": f"flood {i}", "max_tokens": 2048, "ignore_eos": True})
                 for i in range(96)]
        d.wait_until(lambda: b.status()["inflight"] == len(flood), 30, "a's flood admitted")
        loaded = victim_latencies(b, victims)
        ended_early = b.status()["inflight"] < len(flood)   # a's flood ran out before b was measured
        for rid in flood:
            a.cancel(rid)
        flood_codes = Counter(final_code(a, rid) for rid in flood)
    p99_idle, p99_flood = percentile(idle, 0.99), percentile(loaded, 0.99)
    ratio = round(p99_flood / p99_idle, 2)
    lost = sum(n for code, n in flood_codes.items() if code == codes.TIMEOUT)
    return Outcome(ratio <= 2 and not ended_early and lost == 0,
                   {"noisy_neighbour": ratio, "p99_idle_ms": round(p99_idle * 1000, 1),
                    "p99_flood_ms": round(p99_flood * 1000, 1), "victim_requests": victims,
                    "flood_finals": dict(flood_codes), "flood_ended_early": ended_early}, lost_finals=lost)


def victim_latencies(client: Client, count: int) -> list[float]:
    """Seconds each of `count` 1-token generates took, one after the other."""
    seconds = []
    for i in range(count):
        started = time.perf_counter()
        client.generate(f"victim {i}", max_tokens=1)
        seconds.append(time.perf_counter() - started)
    return seconds


def attack_frontend_huge_message(run: Run) -> Outcome:
    """One multipart message of 30 frames, each just under the frame limit, sent as fast as it
    goes (at nice 19, as a remote sender takes none of the daemon's CPU): the front-end must not
    buffer it whole."""
    d = run.shared()
    limit = SHARED_LIMITS["max_message_bytes"]
    memory = PeakMemory(d.pid_of("frontend"))
    peer = RawPeer("127.0.0.1", d.port)
    cut = at_lowest_priority(lambda: peer.send_unfinished(30, limit - 64 * 1024, b"x" * MiB))
    peer.close()
    growth = memory.growth_mib()
    return Outcome(growth <= 2 * limit / MiB + 16, {"frontend_rss_growth_mib": growth, "connection_cut": cut,
                                                     "message_mib": round(30 * (limit - 64 * 1024) / MiB)})


def attack_claimed_routing_ids(run: Run) -> Outcome:
    """Clients naming themselves with the routing ids libzmq gives anonymous clients (a counter
    from libc's rand(): the same ids in every process that never seeds it); libzmq asserts when
    its counter reaches a taken id, and the front-end aborted. A fresh daemon: its counter at the
    start."""
    d = run.daemon()
    claimers = [raw_socket(d, b"\x00" + (0x6B8B4567 + n).to_bytes(4, "big")) for n in range(16)]
    claimed = sum((exchange(sock, [header()]) or {}).get("kind") == "ok" for sock in claimers)
    served = 0
    for _ in range(24):
        with d.client(timeout=10) as client:
            served += client.ping()["pong"] is True
    for sock in claimers:
        sock.close()
    frontend_restarts = restarts(d, "frontend")
    return Outcome(served == 24 and frontend_restarts == 0,
                   {"claimed": claimed, "anonymous_served": served, "frontend_restarts": frontend_restarts})


def attack_connection_flood(run: Run) -> Outcome:
    """600 idle connections from one address (127.0.0.1) against a front-end allowed 400
    descriptors: before limits.max_connections_per_address (256) they took them all and a client
    from another address (127.0.0.2) waited for the whole flood."""
    d = run.daemon()
    subprocess.run(["prlimit", "--pid", str(d.pid_of("frontend")), "--nofile=400:400"], check=True)
    flood = [raw_socket(d) for _ in range(600)]
    time.sleep(2)   # the connections made and (past the cap) cut
    victim = zmq.Context.instance().socket(zmq.DEALER)
    victim.setsockopt(zmq.LINGER, 0)
    victim.connect(f"tcp://127.0.0.2:0;127.0.0.1:{d.port}")
    answered = (exchange(victim, [header()], timeout_s=10) or {}).get("kind") == "ok"
    victim.close()
    cut = d.status()["requests"]["incoming"].get("cut_over_address_cap", 0)
    for sock in flood:
        sock.close()
    return Outcome(answered, {"other_address_answered": answered, "cut_over_address_cap": cut})


def attack_frontend_slow_senders(run: Run) -> Outcome:
    """Sixteen peers each trickle a frame just under the limit and never finish it."""
    d = run.shared()
    limit, total = SHARED_LIMITS["max_message_bytes"], SHARED_LIMITS["max_incoming_bytes"]
    memory = PeakMemory(d.pid_of("frontend"))
    peers = [RawPeer("127.0.0.1", d.port) for _ in range(16)]
    cut = [False] * len(peers)

    def trickle(i: int) -> None:
        cut[i] = peers[i].send_unfinished(1, limit - MiB, b"y" * (64 * 1024), pause_s=0.02)

    threads = [threading.Thread(target=trickle, args=(i,)) for i in range(len(peers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    time.sleep(1.0)
    growth = memory.growth_mib()
    for peer in peers:
        peer.close()
    return Outcome(growth <= total / MiB + 16, {"frontend_rss_growth_mib": growth, "connections_cut": sum(cut),
                                                 "held_if_all_kept_mib": round(16 * (limit - MiB) / MiB)})


def attack_many_fields(run: Run) -> Outcome:
    """A context with some 300k scalar fields (quick: 20k): its commits must not stall another
    tenant's control ops (p99 of context.list), or the fields must be refused past a limit."""
    d = run.shared()
    wanted = 20_000 if run.quick else 307_000
    accepted, refused = 0, None
    with d.client(tenant="wide", timeout=120) as wide:
        wide.call("context.open", {"id": "wide"})
        version = 0
        while accepted < wanted:
            changes = [{"name": f"f{accepted + i}", "kind": "set", "meta": {"type": "scalar", "value": i}, "frame": None}
                       for i in range(1024)]
            try:
                version = wide.call("context.update", {"id": "wide", "base": version, "changes": changes})["version"]
                accepted += len(changes)
            except MCPDError as e:
                refused = e.code
                break
        commit_ms, list_ms = commit_and_list_latency(d, wide, version)
    p99 = percentile(list_ms, 0.99) if list_ms else None
    held = refused == codes.TOO_LARGE or (p99 is not None and p99 <= 100)
    return Outcome(held, {"fields_accepted": accepted, "refused": refused, "commit_ms": commit_ms,
                          "other_tenant_list_p99_ms": p99})


def commit_and_list_latency(d: Daemon, wide: Client, version: int) -> tuple[float, list[float]]:
    """Commit one field on the wide context, again and again, while another tenant lists its contexts."""
    stop_at = time.monotonic() + 3
    lists = []

    def other():
        with d.client(tenant="other") as client:
            while time.monotonic() < stop_at:
                t = time.perf_counter()
                client.call("context.list", {})
                lists.append((time.perf_counter() - t) * 1000)

    thread = threading.Thread(target=other)
    thread.start()
    commits = []
    while time.monotonic() < stop_at:
        t = time.perf_counter()
        try:
            version = wide.call("context.update", {"id": "wide", "base": version, "changes": [
                {"name": "f0", "kind": "set", "meta": {"type": "scalar", "value": version}, "frame": None}]})["version"]
        except MCPDError:
            break
        commits.append((time.perf_counter() - t) * 1000)
    thread.join(30)
    return (round(sorted(commits)[len(commits) // 2], 1) if commits else None), lists


def attack_port_in_use(run: Run) -> Outcome:
    """A second daemon on a TCP port already taken must exit non-zero with the reason."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        d = Daemon(server={"tcp": f"tcp://127.0.0.1:{port}"})
        run.started.append(d)
        d.start(wait=False)
        seen = outcome_of_start(d, 20)
    finally:
        holder.close()
    held = seen["state"] == "exited" and seen["exit_code"] != 0 and str(port) in d.log()
    return Outcome(held, seen)


def attack_full_disk(run: Run) -> Outcome:
    """The state dir on a 2 MiB tmpfs filled by context updates: a documented, retryable code
    (not INTERNAL), and the daemon serves on."""
    mount = Path(tempfile.mkdtemp(prefix="mcpd-full-", dir="/tmp"))
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True).returncode:
        return Outcome(True, {"skipped": "cannot mount a tmpfs here (needs root)"})
    try:
        d = run.daemon(server={"state_dir": str(mount / "state")})
        code = None
        with d.client(timeout=30) as client:
            mirror = client.context("filler")
            for i in range(64):
                try:
                    mirror[f"blob{i}"] = os.urandom(256 * 1024)
                    mirror.sync()
                except MCPDError as e:
                    code = e.code
                    break
            alive = served(client)
        stop(d)
        run.started.remove(d)
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
        mount.rmdir()
    return Outcome(code not in (None, codes.INTERNAL) and alive == "served", {"full_disk_code": code, "after": alive})


def attack_mcpctl_version(run: Run) -> Outcome:
    """`mcpctl version` against a control socket whose reply lacks `version` (an older or a
    foreign daemon): a clear answer and exit code, not a traceback."""
    runtime_dir = Path(tempfile.mkdtemp(prefix="mcpd-v-", dir="/tmp"))
    control = zmq.Context.instance().socket(zmq.ROUTER)
    control.setsockopt(zmq.LINGER, 0)
    control.bind(f"ipc://{runtime_dir / 'control.ipc'}")

    def answer():
        if control.poll(10_000):
            identity, request = control.recv_multipart()
            request_id = msgpack.unpackb(request)["id"]
            control.send_multipart([identity, wire.ok_reply(request_id, {"pong": True})])

    thread = threading.Thread(target=answer)
    thread.start()
    done = subprocess.run([str(Path(sys.executable).parent / "mcpctl"), "--runtime-dir", str(runtime_dir), "version"],
                          capture_output=True, text=True, timeout=30)
    thread.join(15)
    control.close()
    traceback = "Traceback" in done.stderr
    return Outcome(not traceback and done.returncode in (0, 1), {"exit_code": done.returncode, "traceback": traceback})


# -- earlier sets: hostile input ------------------------------------------------------------------

GARBAGE = [
    [b""], [b"\xc1\xc1 not msgpack"], [msgpack.packb([1, 2, 3])], [msgpack.packb({"v": 1, "op": "ping"})],
    [header(id=[1])], [header(v=99)], [header(op="launch")], [header(args=[])], [header(timeout_ms=-1)],
    [header()] + [b"x"] * 20,                                   # too many frames
    [header(op="generate", args={"prompt": "x", "max_tokens": 10 ** 9})],
    [header(op="generate", args={"prompt_token_ids": [10 ** 6]})],
    [header(op="cancel", args={})], [header(), b"\x00" * (9 * MiB // 2), b"\x00" * (9 * MiB // 2)],   # too many bytes
]

MSGPACK_ABUSE = [
    b"\xdf\xff\xff\xff\xff",                                    # a map claiming 4G entries
    b"\xdd\x00\x00\x9c\x40" + b"\x00" * 8,                      # an array claiming 40000 items
    b"\xdb\xff\xff\xff\xff",                                    # a str claiming 4 GiB
    b"\x91" * 5000 + b"\x00",                                   # arrays nested 5000 deep
    msgpack.packb({1: 2}),                                      # an int key
    msgpack.packb({"v": 1, "op": "ping", "id": msgpack.ExtType(1, b"x")}),
    b"\x81\xa1v\xa2\xff\xfe",                                   # invalid UTF-8
    msgpack.packb({"v": 1, "op": "ping", "id": 1}) + b"\x00",   # trailing bytes
]


def every_reply_an_error(d: Daemon, messages: list[list[bytes]]) -> Outcome:
    before = {role: restarts(d, role) for role in ("frontend", "scheduler", "worker")}
    sock = raw_socket(d)
    answers = Counter()
    for frames in messages:
        reply = exchange(sock, frames)
        if reply is None and sum(map(len, frames)) > SHARED_LIMITS["max_message_bytes"]:
            answers["cut"] += 1   # documented: a connection sending more than a request may is cut
        else:
            answers["no reply" if reply is None else reply.get("code", "ok")] += 1
    sock.close()
    with d.client() as client:
        alive = served(client)
    restarted = sum(restarts(d, role) - n for role, n in before.items())
    held = set(answers) <= {codes.BAD_REQUEST, codes.TOO_LARGE, codes.UNSUPPORTED_VERSION, codes.UNKNOWN_OP, "cut"} \
        and alive == "served" and restarted == 0
    return Outcome(held, {"replies": dict(answers), "after": alive, "restarts": restarted})


def attack_garbage_frames(run: Run) -> Outcome:
    return every_reply_an_error(run.shared(), GARBAGE)


def attack_msgpack_abuse(run: Run) -> Outcome:
    return every_reply_an_error(run.shared(), [[frame] for frame in MSGPACK_ABUSE])


def zstd_bombs() -> list[bytes]:
    import zstandard
    return [zstandard.ZstdCompressor().compress(b"\0" * (256 * MiB)),                    # declares 256 MiB
            zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (64 * MiB)),  # declares nothing
            b"\x28\xb5\x2f\xfd" + os.urandom(64)]                                         # not a frame at all


def attack_zstd_bombs(run: Run) -> Outcome:
    """zstd frames that would inflate far past what they declare: refused before decompression."""
    d = run.shared()
    memory = PeakMemory(d.pid_of("scheduler"))
    sock = raw_socket(d)
    answers = Counter()
    with d.client() as client:
        base = client.call("context.open", {"id": "bombed"})["version"]
    for bomb in zstd_bombs():
        entry = {"name": "w", "kind": "set", "frame": 0,
                 "meta": {"type": "array", "dtype": "<f4", "shape": [4], "codec": "zstd", "nbytes": 16}}
        reply = exchange(sock, [header("context.update", args={"id": "bombed", "base": base, "changes": [entry]}), bomb])
        answers["no reply" if reply is None else reply.get("code", "ok")] += 1
    sock.close()
    growth = memory.growth_mib()
    held = set(answers) <= {codes.BAD_REQUEST, codes.TOO_LARGE} and growth < 64
    return Outcome(held, {"replies": dict(answers), "scheduler_rss_growth_mib": growth})


def attack_cross_tenant(run: Run) -> Outcome:
    """Tenant b tries every context op, and a turn, on tenant a's context."""
    d = run.shared()
    with d.client(tenant="a") as a:
        secret = a.context("secret")
        secret["w"] = b"a's data"
        secret.sync()
    seen = {}
    with d.client(tenant="b") as b:
        for op, args in (("context.open", {"id": "secret", "create": False}), ("context.get", {"id": "secret"}),
                         ("context.update", {"id": "secret", "base": 1, "changes": []}),
                         ("context.drop", {"id": "secret"})):
            try:
                seen[op] = "served: " + str(b.call(op, args))[:60]
            except MCPDError as e:
                seen[op] = e.code
        seen["context.list"] = [c["id"] for c in b.call("context.list", {})["contexts"]]
        try:
            b.generate(context="secret", max_tokens=2)
            seen["turn"] = "served"
        except MCPDError as e:
            seen["turn"] = e.code
    with d.client(tenant="a") as a:
        intact = a.context("secret", create=False)["w"] == b"a's data"
    held = intact and "secret" not in seen["context.list"] and seen["context.drop"] in (
        codes.NOT_FOUND, "served: {'dropped': False}") and all(   # drop answers as for a context that is not there
        seen[k] == codes.NOT_FOUND for k in ("context.open", "context.get", "context.update", "turn"))
    return Outcome(held, {**seen, "intact": intact})


# -- the HTTP listener ---------------------------------------------------------------------------

def http_port(d: Daemon) -> int:
    return int(d.control("config")["config"]["http"]["listen"].rpartition(":")[2])


def http_exchange(port: int, data: bytes, timeout_s: float = 30, pause_s: float = 0, slow_from: int = 0) -> bytes:
    """Send raw bytes (from `slow_from` on a byte at a time, `pause_s` apart, when pausing) and
    read the answer's status line; b"closed" if the server closed without one."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        try:
            sock.sendall(data[:slow_from] if pause_s else data)
            for i in range(slow_from, len(data) if pause_s else 0):
                sock.sendall(data[i:i + 1])
                time.sleep(pause_s)
        except OSError:
            pass   # the server answered and closed: its answer may be waiting
        try:
            return sock.recv(4096).split(b"\r\n", 1)[0] or b"closed"
        except OSError:
            return b"closed"


def http_post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s"
            % (path.encode(), extra, len(body), body))


def http_still_serves(port: int) -> bool:
    body = json.dumps({"model": "mcpd-embedded-llama", "prompt": "Hi", "max_tokens": 2}).encode()
    return http_exchange(port, http_post("/v1/completions", body)).startswith(b"HTTP/1.1 200")


def attack_http_oversized_bodies(run: Run) -> Outcome:
    """A 1 GiB Content-Length, and a chunked body that never stops: 413 before they are held."""
    d = run.shared()
    port, limit = http_port(d), SHARED_HTTP["max_body_bytes"]
    memory = PeakMemory(d.pid_of("frontend"))
    declared = http_exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n{"
                             % (1 << 30))
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(4 * limit // 65536 + 1 if run.quick else 64 * limit // 65536):
                sock.sendall(b"10000\r\n" + b"z" * 65536 + b"\r\n")
        except OSError:
            pass   # the server answered and stopped reading
        chunked = sock.recv(4096).split(b"\r\n", 1)[0]
    growth = memory.growth_mib()
    held = b" 413 " in declared and b" 413 " in chunked and growth <= 2 * limit / MiB + 16 and http_still_serves(port)
    return Outcome(held, {"declared_1gib": declared.decode(), "chunked": chunked.decode(), "frontend_rss_growth_mib": growth})


def attack_http_slow_bodies(run: Run) -> Outcome:
    """Sixteen clients trickle their bodies a byte at a time (each gets 408 after
    http.body_timeout_s) and sixteen their headers (closed after http.keepalive_timeout_s); a
    normal client is served meanwhile."""
    d = run.shared()
    port = http_port(d)
    answers: dict[str, list[bytes]] = {"body": [], "headers": []}
    request = http_post("/v1/completions", json.dumps({"model": "mcpd-embedded-llama", "prompt": "Hi"}).encode())
    body_from = request.index(b"\r\n\r\n") + 4

    def slow(part: str, slow_from: int) -> None:
        answers[part].append(http_exchange(port, request, pause_s=0.25, slow_from=slow_from))
    threads = [threading.Thread(target=slow, args=(part, start)) for part, start in (("body", body_from), ("headers", 0))
               for _ in range(16)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    started = time.monotonic()
    served = http_still_serves(port)
    served_s = round(time.monotonic() - started, 3)
    for thread in threads:
        thread.join(60)
    timed_out = sum(answer.startswith(b"HTTP/1.1 408") for answer in answers["body"])
    closed = sum(answer == b"closed" for answer in answers["headers"])
    return Outcome(served and timed_out == 16 and closed == 16,
                   {"slow_bodies_answered_408": timed_out, "slow_headers_closed": closed, "of_each": 16,
                    "normal_request_s": served_s})


BAD_BODIES = [b"{", b"[1, 2]", b"null", b"\xff\xfe", b"[" * 100000, b'{"model": ' + b"1" * 5000 + b"}",
              b'{"model": "mcpd-embedded-llama", "prompt": "\\ud800"}',
              b'{"model": "mcpd-embedded-llama", "prompt": "x", "seed": 1' + b"0" * 30 + b"}",
              b'{"model": "mcpd-embedded-llama", "prompt": "x", "temperature": 1e999}',
              b'{"model": "mcpd-embedded-llama", "messages": [{"role": "user", "content": {"a": 1}}]}',
              b'{"model": "mcpd-embedded-llama", "prompt": "x", "max_tokens": -1}']


def attack_http_bad_json(run: Run) -> Outcome:
    """Bodies that are not JSON, nested too deep, ints past Python's digit limit, lone surrogates,
    numbers msgpack cannot carry, wrong types: every one a 400 in OpenAI's shape, none a 500."""
    d = run.shared()
    port = http_port(d)
    statuses = Counter()
    for body in BAD_BODIES:
        for path in ("/v1/completions", "/v1/chat/completions"):
            statuses[http_exchange(port, http_post(path, body)).decode(errors="replace")] += 1
    held = set(statuses) == {"HTTP/1.1 400 Bad Request"} and http_still_serves(port)
    return Outcome(held, {"answers": dict(statuses)})


def attack_http_header_flood(run: Run) -> Outcome:
    """10,000 headers; one header of 1 MiB; a request line of 1 MiB: refused by the parser."""
    d = run.shared()
    port = http_port(d)
    memory = PeakMemory(d.pid_of("frontend"))
    many = b"".join(b"X-H%d: %s\r\n" % (i, b"a" * 90) for i in range(10000))
    answers = {"many_headers": http_exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n"),
               "huge_header": http_exchange(port, b"GET /v1/models HTTP/1.1\r\nX-Big: " + b"b" * MiB + b"\r\n\r\n"),
               "huge_line": http_exchange(port, b"GET /" + b"c" * MiB + b" HTTP/1.1\r\nHost: x\r\n\r\n")}
    growth = memory.growth_mib()
    refused = all(a.startswith(b"HTTP/1.0 400") or a.startswith(b"HTTP/1.1 400") or a == b"closed" for a in answers.values())
    return Outcome(refused and growth <= 32 and http_still_serves(port),
                   {**{k: v.decode(errors="replace") for k, v in answers.items()}, "frontend_rss_growth_mib": growth})


def attack_http_idle_connections(run: Run) -> Outcome:
    """Hundreds of connections that send nothing, and as many left idle after one request: a
    normal client is still served, and idle keep-alive ones are closed after keepalive_timeout_s."""
    d = run.shared()
    port = http_port(d)
    count = 200 if run.quick else 800
    # from 8 addresses, each under limits.max_connections_per_address (http_connection_flood tries the caps)
    silent = [socket.create_connection(("127.0.0.1", port), source_address=(f"127.0.0.{10 + i % 8}", 0))
              for i in range(count)]
    body = json.dumps({"model": "mcpd-embedded-llama", "prompt": "x", "max_tokens": 1}).encode()
    idle = []
    for i in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(f"127.0.0.{10 + i % 8}", 0))
        sock.sendall(http_post("/v1/completions", body))
        sock.recv(4096)
        idle.append(sock)
    served = http_still_serves(port)
    fds_open = len(os.listdir(f"/proc/{d.pid_of('frontend')}/fd"))
    time.sleep(SHARED_HTTP["keepalive_timeout_s"] + 2)
    closed = Counter()
    for name, socks in (("silent", silent), ("idle", idle)):
        for sock in socks:
            sock.settimeout(0.5)
            try:
                closed[name] += sock.recv(1) == b""
            except OSError:
                pass
    fds_after = len(os.listdir(f"/proc/{d.pid_of('frontend')}/fd"))
    for sock in silent + idle:
        sock.close()
    return Outcome(served and closed["silent"] == closed["idle"] == count and http_still_serves(port),
                   {"silent": count, "idle_after_a_request": count, "closed_by_server": dict(closed),
                    "frontend_fds_open": fds_open, "frontend_fds_after_keepalive_timeout": fds_after})


def attack_local_identity(run: Run) -> Outcome:
    """A ZeroMQ client naming itself b"\\x00local", the routing id HTTP requests were once filed
    under, pings, cancels ids 1..256 and closes while an HTTP stream runs: the stream ends with
    "length" and the client gets its own replies, every one of them and nothing else."""
    d = run.shared()
    body = json.dumps({"model": "mcpd-embedded-llama", "messages": [{"role": "user", "content": "Hi"}],
                       "max_tokens": 1000, "ignore_eos": True, "stream": True})
    connection = http.client.HTTPConnection("127.0.0.1", http_port(d), timeout=60)
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    events = (json.loads(line[6:]) for line in iter(connection.getresponse().readline, b"")
              if line.startswith(b"data: {"))
    next(events)   # streaming: the impostor comes while it runs
    got = impostor_replies(d, cancels=256)
    finish = [choice["finish_reason"] for event in events for choice in event.get("choices", [])][-1:]
    connection.close()
    cancels = {target: {"cancelled": False} for target in range(1, 257)}
    own = (got.get(0) or {}).get("pong") is True and {i: got[i] for i in got if i != 0} == cancels
    return Outcome(finish == ["length"] and own, {"stream_finish": finish, "impostor_replies": len(got),
                                                 "impostor_got_its_own": own})


def impostor_replies(d: Daemon, cancels: int) -> dict:
    """Request id -> result of what a DEALER named b"\\x00local" got back for a ping (id 0) and a
    cancel of each id 1..cancels (the cancel's own id the same), until all came or one is 5 s late;
    then it closes."""
    sock = raw_socket(d, b"\x00local")
    sock.send(wire.encode_request("ping", 0, {}))
    for target in range(1, cancels + 1):
        sock.send(wire.encode_request("cancel", target, {"target": target}))
    got = {}
    while len(got) <= cancels and sock.poll(5000):
        reply = wire.decode_reply(sock.recv())
        got[reply.get("id")] = reply.get("result", reply.get("code"))
    sock.close()
    return got


def attack_http_connection_flood(run: Run) -> Outcome:
    """1,100 idle HTTP connections from 5 addresses (each under the per-address cap) against a
    front-end allowed 1,024 descriptors: before the HTTP listener had a total cap they took every
    descriptor, a ZeroMQ client of another address waited 8 s, and accepts failed in a loop."""
    d = run.daemon(http={"listen": f"127.0.0.1:{free_port()}"})
    frontend = d.pid_of("frontend")
    subprocess.run(["prlimit", "--pid", str(frontend), "--nofile=1024:1024"], check=True)
    cpu = psutil.Process(frontend)
    cpu_before = sum(cpu.cpu_times()[:2])
    flood = []
    for i in range(11):   # a batch at a time, within the listener's backlog
        flood += [socket.create_connection(("127.0.0.1", http_port(d)), timeout=30,
                                           source_address=(f"127.0.0.{10 + i % 5}", 0)) for _ in range(100)]
    time.sleep(2)   # the flood taken: accepted, idle ones shed
    cpu_s = round(sum(cpu.cpu_times()[:2]) - cpu_before, 2)
    victim = zmq.Context.instance().socket(zmq.DEALER)
    victim.setsockopt(zmq.LINGER, 0)
    victim.connect(f"tcp://127.0.0.2:0;127.0.0.1:{d.port}")
    started = time.monotonic()
    answered = (exchange(victim, [header()], timeout_s=5) or {}).get("kind") == "ok"
    ping_ms = round((time.monotonic() - started) * 1000, 1)
    victim.close()
    served = http_still_serves(http_port(d))
    listener = d.status()["http"]
    for sock in flood:
        sock.close()
    kept = d.pid_of("frontend") == frontend
    return Outcome(answered and served and kept and listener["connections"] <= listener["max_connections"],
                   {"other_address_ping_ms": ping_ms if answered else None, "http_served": served,
                    "frontend_restarted": not kept, "frontend_cpu_s_during_flood": cpu_s,
                    **{k: listener[k] for k in ("connections", "max_connections", "idle_shed", "refused",
                                            "accept_pauses")}})


# -- earlier sets: faults -------------------------------------------------------------------------

def attack_kill_worker(run: Run) -> Outcome:
    """SIGKILL the worker under a closed-loop load: every request must still get its final."""
    d = run.daemon()
    outcomes, sent, stop_load = Counter(), Counter(), threading.Event()

    def client_loop(i: int) -> None:
        with d.client(timeout=120) as client:
            while not stop_load.is_set():
                sent["n"] += 1
                try:
                    client.generate(f"load {i}", max_tokens=16, ignore_eos=True)
                    outcomes["ok"] += 1
                except MCPDError as e:
                    outcomes[e.code] += 1

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    time.sleep(2)
    os.kill(d.pid_of("worker"), signal.SIGKILL)
    d.wait_until(lambda: d.status()["state"] == "ready", 60, "worker back")
    time.sleep(1)
    stop_load.set()
    for thread in threads:
        thread.join(120)
    unanswered = sent["n"] - sum(outcomes.values()) + outcomes[codes.TIMEOUT]
    return Outcome(unanswered == 0, {"requests": sent["n"], "outcomes": dict(outcomes)}, lost_finals=unanswered)


def attack_kill_scheduler(run: Run) -> Outcome:
    """SIGKILL the scheduler with streams running and contexts committed: the streams are answered
    and every acknowledged version survives."""
    d = run.daemon()
    with d.client() as client:
        acked = commit_versions(client, contexts=3, versions=5)
        streams = [client.send("generate", {"prompt": f"s{i}", "max_tokens": 2000, "ignore_eos": True,
                                            "stream": True}) for i in range(3)]
        client.receive(streams[0])
        os.kill(d.pid_of("scheduler"), signal.SIGKILL)
        stream_codes = Counter(final_code(client, rid) for rid in streams)
        d.wait_until(lambda: d.status()["state"] == "ready", 60, "scheduler back")
        restored = context_versions(client, list(acked))
    lost_finals = stream_codes[codes.TIMEOUT]
    lost = lost_versions(acked, restored)
    return Outcome(lost_finals == 0 and lost == 0, {"streams": dict(stream_codes), "acked": acked, "restored": restored},
                   lost_finals=lost_finals, lost_updates=lost)


def attack_kill_supervisor(run: Run) -> Outcome:
    """SIGKILL the supervisor: its children go, a restart gets every acknowledged version back, and
    no shared-memory segment is left behind once the restarted daemon stops."""
    d = run.daemon()
    with d.client() as client:
        acked = commit_versions(client, contexts=3, versions=5)
    children = [p["pid"] for p in d.processes() if p["role"] != "supervisor"]
    os.kill(d.process.pid, signal.SIGKILL)
    d.process.wait()
    deadline = time.monotonic() + 20
    while any(Path(f"/proc/{pid}").exists() for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    orphans = sum(Path(f"/proc/{pid}").exists() for pid in children)
    segment = segment_path(d.runtime_dir)
    left_by_kill = segment.exists()
    d.start()
    with d.client() as client:
        restored = context_versions(client, list(acked))
    d.stop()
    lost = lost_versions(acked, restored)
    return Outcome(lost == 0 and orphans == 0 and not segment.exists(),
                   {"orphans": orphans, "shm_left_by_the_kill": left_by_kill,
                    "shm_left_after_restart_and_stop": segment.exists(), "restored": restored},
                   lost_updates=lost)


def attack_version_storm(run: Run) -> Outcome:
    """A careless operator's storm of version switches under 8 closed-loop clients (load b, split
    to it, unload c, splits, rollback, load c, promote c then a, unload b), its worst ordering
    forced (mcpd.testing.version_storm): every request gets its final, and each version answered
    as many requests as were routed to it."""
    d = run.daemon(**STORM_CONFIG)
    with SteadyLoad(d, 8, timeout=30, key_each=True, max_tokens=2, temperature=0) as load:
        load.wait_for(8)
        unloaded = version_storm(d, load)
        load.wait_for(8)
    routed = {v: f["routed"] for v, f in d.status()["models"]["models"]["m"]["versions"].items()}
    answered = Counter(load.versions)
    lost = sum(routed.values()) - len(load.versions) - len(load.failed) + load.failed.count(codes.TIMEOUT)
    return Outcome(lost == 0 and not load.failed and all(answered[v] == n for v, n in routed.items()),
                   {"routed": routed, "answered": dict(answered), "failed": dict(Counter(load.failed)),
                    "unload_b": unloaded.get("loaded")}, lost_finals=lost)


ATTACKS = {
    # on the shared daemon, cheapest first; poison last of them, since today it restarts the worker
    "garbage_frames": attack_garbage_frames, "msgpack_abuse": attack_msgpack_abuse,
    "zstd_bombs": attack_zstd_bombs, "cross_tenant": attack_cross_tenant,
    "frontend_huge_message": attack_frontend_huge_message, "frontend_slow_senders": attack_frontend_slow_senders,
    "slow_consumer": attack_slow_consumer, "many_fields": attack_many_fields,
    "http_oversized_bodies": attack_http_oversized_bodies, "http_slow_bodies": attack_http_slow_bodies,
    "http_bad_json": attack_http_bad_json, "http_header_flood": attack_http_header_flood,
    "http_idle_connections": attack_http_idle_connections, "local_identity": attack_local_identity,
    "poison_request": attack_poison_request,
    # their own daemons
    "claimed_routing_ids": attack_claimed_routing_ids, "connection_flood": attack_connection_flood,
    "http_connection_flood": attack_http_connection_flood, "noisy_neighbour": attack_noisy_neighbour,
    "priority_inversion": attack_priority_inversion, "cache_filling": attack_cache_filling,
    "damaged_journal": attack_damaged_journal, "damaged_snapshot": attack_damaged_snapshot,
    "journal_is_a_directory": attack_journal_is_a_directory, "journal_over_field_limit": attack_journal_over_field_limit,
    "curve_identity": attack_curve_identity, "undecodable_key": attack_undecodable_key, "umask_000": attack_umask_000,
    "planted_runtime_dir": attack_planted_runtime_dir, "shared_state_dir": attack_shared_state_dir,
    "port_in_use": attack_port_in_use, "full_disk": attack_full_disk, "mcpctl_version": attack_mcpctl_version,
    "kill_worker": attack_kill_worker, "kill_scheduler": attack_kill_scheduler, "kill_supervisor": attack_kill_supervisor,
    "version_storm": attack_version_storm,
}
QUICK = ("garbage_frames", "msgpack_abuse", "zstd_bombs", "cross_tenant", "frontend_huge_message",
         "frontend_slow_senders", "slow_consumer", "many_fields", "http_oversized_bodies", "http_slow_bodies",
         "http_bad_json", "http_header_flood", "http_idle_connections", "local_identity", "poison_request",
         "mcpctl_version", "noisy_neighbour")


def run_one(run: Run, attack) -> Outcome:
    """The attack in a thread, within ATTACK_LIMIT_S; whatever it raises is a broken promise too."""
    result: list[Outcome] = []

    def body():
        try:
            result.append(attack(run))
        except Exception as e:   # noqa: BLE001 - an attack that blows up is reported, not fatal
            result.append(Outcome(False, {"error": f"{type(e).__name__}: {e}"[:300]}))

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(ATTACK_LIMIT_S)
    return result[0] if result else Outcome(False, {"error": f"did not finish in {ATTACK_LIMIT_S} s"})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}, at smaller sizes")
    parser.add_argument("--only", nargs="*", choices=list(ATTACKS), help="run these attacks only")
    args = parser.parse_args()
    chosen = args.only or (list(QUICK) if args.quick else list(ATTACKS))
    run, results = Run(args.quick), {}
    try:
        for name in chosen:
            started = time.monotonic()
            outcome = run_one(run, ATTACKS[name])
            run.stop_own()
            results[name] = outcome
            print(f"{name:26} {'held' if outcome.held else 'BROKEN':6} {time.monotonic() - started:5.1f}s  "
                  f"{json.dumps(outcome.figures, default=str)[:400]}", flush=True)
    finally:
        run.stop_all()
    broken = [name for name, o in results.items() if not o.held]
    lost = sum(o.lost_finals + o.lost_updates for o in results.values())
    print(f"{len(results) - len(broken)} held, {len(broken)} broken ({', '.join(broken) or 'none'}); "
          f"{lost} finals or acknowledged updates lost")
    print(json.dumps({"broken": len(broken), "lost": lost, "quick": args.quick,
                      "skipped": [name for name in ATTACKS if name not in chosen],
                      "attacks": {name: {"held": o.held, "lost_finals": o.lost_finals, "lost_updates": o.lost_updates,
                                         **o.figures} for name, o in results.items()}}, default=str))


if __name__ == "__main__":
    main()
