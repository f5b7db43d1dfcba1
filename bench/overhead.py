"""No-op overhead: `ping` through front-end -> scheduler -> worker -> back, against a raw pyzmq
DEALER/ROUTER echo measured in the same run (same client code, same machine, same moment).

    python bench/overhead.py [--quick] [--only noop] [--kernels auto|native-avx2|...]

Prints p50/p99 of sequential round trips and the throughput of pipelined requests, then one
JSON line. The target is noop_p50_ratio_vs_relay <= 1.3: the ping's p50 over that of a bare
relay chain of three pyzmq processes with the daemon's five hops (ROUTER -> PUSH -> PULL/PUSH ->
PULL/PUSH -> PULL -> ROUTER) and no logic at all, measured in the same rounds, so what is hop
count and what is mcpd's code are told apart (floor_p50_ratio_vs_raw: the hops alone).
The sequential pings run in LATENCY_ROUNDS short rounds that alternate between the targets; a p50
ratio is the median of the rounds' own ratios, printed with the middle half of them (_q1, _q3):
a shared machine's busy moments move a whole run's p50s far more than they move a round's ratio.
The same chain with its three internal hops on plain Unix stream sockets (read and written by
each process's own thread, no ZeroMQ I/O thread between them) shows what replacing the daemon's
internal ZeroMQ sockets could win at most (unix_floor_p50_ratio_vs_raw).
These rounds run with no other daemon on the machine: an idle daemon's processes wake on the same
two cores, and that neighbour is no part of mcpd's cost per hop. Then a second daemon runs with
CURVE on (authenticated, encrypted; the front-end reads each message's User-Id and re-packs its
header) and is measured against the plaintext daemon in rounds of their own:
curve_p50_ratio_vs_plain (aim <= 1.3) compares its ping p50 with the plaintext daemon's.
Last, a 1-token generate (1-token prompt, max_tokens 1) on the daemon's model (the embedded one:
a step of the engine, not a big model's weight read): one_token_server_ms is its p50 round trip
less the raw echo's, what the daemon adds to a socket round trip (target <= 1.5 ms), measured with
no other daemon running: an idle daemon's processes still wake on the same two cores.
Tracing: two more daemons with [tracing] on (the file exporter), at sample_ratio 1.0 and 0, take the
same 1-token generate in rounds interleaved with the plain daemon's: tracing_p50_overhead is the
p50 with every request traced over the p50 with tracing off (target <= 1.1), and
tracing_ratio0_overhead that with tracing on and no request sampled over off (aim: within the noise).
Then context turns (W3's shape: a turn on a context that holds earlier turns) on the traced
daemon: each trace's spans (tracing_turn_spans) and processes (tracing_turn_processes), at
least, and the durations of the spans on a turn's path (admission, queue, dispatch, the
worker's, the commit, the reply and the hops between the processes: TURN_PATH) added up over the
client's measured time, the median of the turns (tracing_turn_spans_frac, target >= 0.9: the
rest is the client's own time and its socket's).
Every daemon here reports its figures at the shipped interval (shipped_daemon), as
bench/peers.py's does.
mcpd_cpu_us_per_ping is the CPU time (user + system, every thread) the front-end, scheduler and
worker spend per pipelined ping: on a machine shared with other work it moves far less than the
ratios, which divide two noisy timings.
--only noop also prints each process's CPU per sequential ping (cpu_us_per_ping, every thread),
the daemon's beside the relay chain's process in the same place (its first process stands for the
front-end, its second for the scheduler, its third for the worker): which hop holds the difference.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import struct
import tempfile
import time

import psutil
import zmq

from mcpd.client import Client, CurveKeys
from mcpd.config import SupervisorConfig
from mcpd.percentile import percentile
from mcpd.protocol import wire
from mcpd.testing import Daemon, free_port

ROUNDS = 3            # pipelined (throughput) rounds; the sequential pings a target: ROUNDS * count
LATENCY_ROUNDS = 30   # the sequential pings in short alternating rounds, a ratio per round


def echo_server(endpoint: str) -> None:
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(endpoint)
    while True:
        sock.send_multipart(sock.recv_multipart())


def relay_front(client_endpoint: str, out_endpoint: str, back_endpoint: str) -> None:
    context = zmq.Context()
    clients, out, back = context.socket(zmq.ROUTER), context.socket(zmq.PUSH), context.socket(zmq.PULL)
    clients.bind(client_endpoint)
    out.connect(out_endpoint)
    back.bind(back_endpoint)
    poller = zmq.Poller()
    poller.register(clients, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if clients in ready:
            out.send_multipart(clients.recv_multipart())
        if back in ready:
            clients.send_multipart(back.recv_multipart())


def relay_hop(in_endpoint: str, out_endpoint: str) -> None:
    context = zmq.Context()
    source, sink = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    source.bind(in_endpoint)
    sink.connect(out_endpoint)
    while True:
        sink.send_multipart(source.recv_multipart())


def start_relay_chain(client_endpoint: str, ipc_dir: str) -> list[multiprocessing.Process]:
    spawn = multiprocessing.get_context("spawn")
    sched, worker, front = (f"ipc://{ipc_dir}/{name}" for name in ("sched", "worker", "front"))
    processes = [spawn.Process(target=relay_front, args=(client_endpoint, sched, front), daemon=True),
                 spawn.Process(target=relay_hop, args=(sched, worker), daemon=True),
                 spawn.Process(target=relay_hop, args=(worker, front), daemon=True)]
    for process in processes:
        process.start()
    return processes


# The same relay chain with its three internal hops on plain Unix stream sockets (length-prefixed
# frames, written and read by the process's own thread): what the daemon's latency could come
# down to with no ZeroMQ I/O thread between its own processes (the p50 such sockets would reach; not built).
def _send_unix(sock: socket.socket, frames: list[bytes]) -> None:
    sock.sendall(b"".join(struct.pack("!I", len(f)) + f for f in [struct.pack("!I", len(frames)), *frames]))


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("relay peer closed")
        data += chunk
    return data


def _recv_unix(sock: socket.socket) -> list[bytes]:
    def frame() -> bytes:
        return _recv_exact(sock, struct.unpack("!I", _recv_exact(sock, 4))[0])
    return [frame() for _ in range(struct.unpack("!I", frame())[0])]


def _unix_pair(listen_path: str, connect_path: str) -> tuple[socket.socket, socket.socket]:
    """(accepted inbound, connected outbound): listens, then connects once the next one listens."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(listen_path)
    listener.listen(1)
    out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    while True:
        try:
            out.connect(connect_path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.01)
    return listener.accept()[0], out


def unix_relay_front(client_endpoint: str, ipc_dir: str) -> None:
    clients = zmq.Context().socket(zmq.ROUTER)
    clients.bind(client_endpoint)
    back, out = _unix_pair(f"{ipc_dir}/u-front", f"{ipc_dir}/u-sched")
    poller = zmq.Poller()
    poller.register(clients, zmq.POLLIN)
    poller.register(back.fileno(), zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if clients in ready:
            _send_unix(out, clients.recv_multipart())
        if back.fileno() in ready:
            clients.send_multipart(_recv_unix(back))


def unix_relay_hop(name: str, next_name: str, ipc_dir: str) -> None:
    source, sink = _unix_pair(f"{ipc_dir}/u-{name}", f"{ipc_dir}/u-{next_name}")
    while True:
        _send_unix(sink, _recv_unix(source))


def start_unix_relay_chain(client_endpoint: str, ipc_dir: str) -> list[multiprocessing.Process]:
    spawn = multiprocessing.get_context("spawn")
    processes = [spawn.Process(target=unix_relay_front, args=(client_endpoint, ipc_dir), daemon=True),
                 spawn.Process(target=unix_relay_hop, args=("sched", "worker", ipc_dir), daemon=True),
                 spawn.Process(target=unix_relay_hop, args=("worker", "front", ipc_dir), daemon=True)]
    for process in processes:
        process.start()
    return processes


def connect(endpoint: str, curve: CurveKeys | None = None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(sock)
    sock.connect(endpoint)
    return sock


ONE_TOKEN = {"prompt_token_ids": [1], "max_tokens": 1, "ignore_eos": True, "temperature": 0}


def sequential(sock: zmq.Socket, count: int, op: str = "ping", args: dict | None = None) -> list[float]:
    """Round-trip seconds of `count` requests sent one after another."""
    times = []
    for i in range(count):
        frame = wire.encode_request(op, i, args)
        started = time.perf_counter()
        sock.send(frame)
        sock.recv_multipart()
        times.append(time.perf_counter() - started)
    return times


def pipelined(sock: zmq.Socket, total: int, window: int) -> float:
    """Requests per second with up to `window` pings outstanding."""
    sent = received = 0
    started = time.perf_counter()
    while received < total:
        while sent < total and sent - received < window:
            sock.send(wire.encode_request("ping", sent))
            sent += 1
        sock.recv_multipart()
        received += 1
    return total / (time.perf_counter() - started)


def latency_rounds(targets: list[tuple[str, CurveKeys | None]], rounds: int, per_round: int) -> list[list[list[float]]]:
    """Round-trip seconds of `per_round` sequential pings on each target, in `rounds` short rounds
    that take turns (the order reversed every other round): a busy moment of a shared machine
    hits a round's targets alike, and the ratios are taken within each round. [round][target]."""
    socks = [connect(endpoint, curve) for endpoint, curve in targets]
    for sock in socks:
        sequential(sock, 200)   # warm up connections and caches
    samples = []
    for number in range(rounds):
        times: list[list[float]] = [[] for _ in socks]
        order = range(len(socks)) if number % 2 == 0 else reversed(range(len(socks)))
        for i in order:
            times[i] = sequential(socks[i], per_round)
        samples.append(times)
    for sock in socks:
        sock.close()
    return samples


def latency_of(samples: list[list[list[float]]], target: int) -> dict:
    """p50 and p99 (µs) of one target's round trips, all rounds together."""
    times = [t for round_times in samples for t in round_times[target]]
    return {"p50_us": statistics.median(times) * 1e6, "p99_us": percentile(times, 0.99) * 1e6}


def round_ratios(samples: list[list[list[float]]], target: int, base: int) -> dict:
    """The target's p50 over the base's, round by round: the median of the rounds' ratios and
    their quartiles (the spread a single ratio would swing over)."""
    ratios = [statistics.median(times[target]) / statistics.median(times[base]) for times in samples]
    return {"median": statistics.median(ratios), "q1": percentile(ratios, 0.25), "q3": percentile(ratios, 0.75)}


def throughputs(targets: list[tuple[str, CurveKeys | None]], total: int, window: int) -> list[float]:
    """Pipelined requests per second of each target, the median of ROUNDS alternating rounds."""
    rates: list[list[float]] = [[] for _ in targets]
    for _ in range(ROUNDS):
        for (endpoint, curve), kept in zip(targets, rates):
            sock = connect(endpoint, curve)
            sequential(sock, 20)
            kept.append(pipelined(sock, total, window))
            sock.close()
    return [statistics.median(kept) for kept in rates]


def one_token_ms(endpoint: str, count: int) -> float:
    """p50 round trip of a 1-token generate (a 1-token prompt, max_tokens 1: peers.py's W4)."""
    sock = connect(endpoint)
    sequential(sock, 20, "generate", ONE_TOKEN)
    times = sequential(sock, count, "generate", ONE_TOKEN)
    sock.close()
    return statistics.median(times) * 1e3


def tracing_p50_ratios(daemons: list[Daemon], count: int) -> list[float]:
    """The 1-token generate's p50 on each daemon over that on the first. The daemons take turns
    request by request, so that a busy moment of a shared machine hits them alike."""
    socks = [connect(d.endpoint) for d in daemons]
    for sock in socks:
        sequential(sock, 20, "generate", ONE_TOKEN)
    times = [[] for _ in daemons]
    for _ in range(count):
        for sock, kept in zip(socks, times):
            kept += sequential(sock, 1, "generate", ONE_TOKEN)
    for sock in socks:
        sock.close()
    p50s = [statistics.median(kept) for kept in times]
    return [p50 / p50s[0] for p50 in p50s[1:]]


TURN_PATH = ("frontend.admit", "hop.to_scheduler", "scheduler.admit", "scheduler.queue", "scheduler.dispatch",
             "hop.to_worker", "worker.generate", "scheduler.commit", "hop.to_frontend", "frontend.reply")
TURN_TENANT = "bench-trace"
TURNS = 10


def traced_turn_seconds(daemon: Daemon, turns: int) -> list[float]:
    """The client's time for each of `turns` turns on one context, after a first that builds it."""
    times = []
    with Client(daemon.endpoint, tenant=TURN_TENANT) as client:
        context = client.context("chat")
        for turn in range(turns + 1):
            started = time.perf_counter()
            result = client.generate(f" Turn {turn}: tell me about the sea.", context="chat", base=context.version,
                                     max_tokens=8, temperature=0, ignore_eos=True)
            times.append(time.perf_counter() - started)
            context.version = result.context.version
    return times[1:]


def turn_trace_figures(spans_path: str, client_times: list[float]) -> dict:
    """The traced turns' traces against the client's times, medians over the turns (the daemon
    stopped: everything is exported). The turns ran one after another: their roots in start order."""
    with open(spans_path) as f:
        spans = [json.loads(line) for line in f]
    roots = sorted((s for s in spans if s["name"] == "mcpd.request" and s["attributes"]["mcpd.op"] == "generate"
                    and s["attributes"]["mcpd.tenant"] == TURN_TENANT), key=lambda s: s["start_ns"])
    traces = [[s for s in spans if s["trace_id"] == root["trace_id"]] for root in roots[-len(client_times):]]
    on_path = [sum(s["end_ns"] - s["start_ns"] for s in trace if s["name"] in TURN_PATH) / 1e9 for trace in traces]
    root_s = [(root["end_ns"] - root["start_ns"]) / 1e9 for root in roots[-len(client_times):]]
    return {"tracing_turn_spans": min(len(trace) for trace in traces),
            "tracing_turn_processes": min(len({s["resource"]["mcpd.process"] for s in trace}) for trace in traces),
            "tracing_turn_root_frac": round(statistics.median(r / c for r, c in zip(root_s, client_times)), 3),
            "tracing_turn_spans_frac": round(statistics.median(p / c for p, c in zip(on_path, client_times)), 3),
            "tracing_turn_client_ms": round(statistics.median(client_times) * 1e3, 2)}


def shipped_daemon(**sections: dict) -> Daemon:
    """A daemon reporting its figures at the shipped interval, not the tests' 0.1 s (mcpd.testing):
    five times as many reports a second would stand in every figure here (bench/peers.py's too)."""
    return Daemon(supervisor={"stats_interval_s": SupervisorConfig.stats_interval_s}, **sections).start()


def traced_daemon(spans_dir: str, ratio: float) -> Daemon:
    tracing = {"enabled": True, "sample_ratio": ratio, "exporter": "file", "path": f"{spans_dir}/spans-{ratio}.jsonl"}
    return shipped_daemon(tracing=tracing)


def cpu_us_per_ping(daemon: Daemon, total: int, window: int) -> float:
    """CPU microseconds the daemon's front-end, scheduler and worker spend per pipelined ping."""
    processes = [psutil.Process(daemon.pid_of(role)) for role in ("frontend", "scheduler", "worker")]

    def spent() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in processes)

    sock = connect(daemon.endpoint)
    before = spent()
    pipelined(sock, total, window)
    used = spent() - before
    sock.close()
    return used / total * 1e6


ROLES = ("frontend", "scheduler", "worker")   # the daemon's processes a ping crosses, in the chain's order


def cpu_ns(pid: int) -> int:
    """On-CPU nanoseconds of every thread of `pid` so far (schedstat: psutil counts clock ticks,
    10 ms, coarser than a round of pings)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
                total += int(stat.read().split()[0])
        except FileNotFoundError:   # a thread that ended meanwhile
            pass
    return total


def cpu_us_per_sequential_ping(endpoint: str, pids: list[int], count: int) -> dict[str, float]:
    """Each process's CPU microseconds per ping sent one after another, by ROLES."""
    sock = connect(endpoint)
    sequential(sock, 50)
    before = [cpu_ns(pid) for pid in pids]
    sequential(sock, count)
    sock.close()
    return {role: round((cpu_ns(pid) - start) / count / 1e3, 1) for role, pid, start in zip(ROLES, pids, before)}


def measure_all(targets: list[tuple[str, CurveKeys | None]], count: int, total: int, window: int):
    """(the latency rounds' samples, each target's p50_us, p99_us and throughput_rps): ROUNDS * count
    sequential pings a target, in LATENCY_ROUNDS interleaved rounds, then the pipelined rounds."""
    samples = latency_rounds(targets, LATENCY_ROUNDS, ROUNDS * count // LATENCY_ROUNDS)
    rates = throughputs(targets, total, window)
    return samples, [{**latency_of(samples, i), "throughput_rps": rate} for i, rate in enumerate(rates)]


def spread_line(name: str, ratio: dict) -> str:
    return f"{name}: {ratio['median']:.3f}, the middle half of the {LATENCY_ROUNDS} rounds {ratio['q1']:.3f}-{ratio['q3']:.3f}"


def client_p50_us(endpoint: str, count: int) -> float:
    with Client(endpoint) as client:
        times = []
        for _ in range(count):
            started = time.perf_counter()
            client.ping()
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def stop_helpers(helpers: list[multiprocessing.Process], ipc_dir: str, daemon: Daemon) -> None:
    for process in helpers:
        process.terminate()
    shutil.rmtree(ipc_dir, ignore_errors=True)
    daemon.stop()
    daemon.cleanup()


def print_table(rows) -> None:
    """(name, measure_all()'s figures) per row."""
    print(f"{'':<28}{'p50 us':>10}{'p99 us':>10}{'req/s':>12}")
    for name, m in rows:
        print(f"{name:<28}{m['p50_us']:>10.1f}{m['p99_us']:>10.1f}{m['throughput_rps']:>12.0f}")


def noop_only(count: int, total: int, window: int, quick: bool) -> None:
    """The ping against the raw echo and the bare relay chain alone, in the same interleaved rounds:
    the no-op ratio without the minutes the other daemons take."""
    raw_endpoint, chain_endpoint = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    ipc_dir = tempfile.mkdtemp(prefix="mcpd-bench-", dir="/tmp")
    helpers = [multiprocessing.get_context("spawn").Process(target=echo_server, args=(raw_endpoint,), daemon=True)]
    helpers[0].start()
    helpers += start_relay_chain(chain_endpoint, ipc_dir)
    daemon = shipped_daemon()
    try:
        targets = [(raw_endpoint, None), (chain_endpoint, None), (daemon.endpoint, None)]
        samples, (raw, chain, mcpd) = measure_all(targets, count, total, window)
        cpu = {"mcpd": cpu_us_per_sequential_ping(daemon.endpoint, [daemon.pid_of(role) for role in ROLES], count),
               "relay": cpu_us_per_sequential_ping(chain_endpoint, [process.pid for process in helpers[1:]], count)}
    finally:
        stop_helpers(helpers, ipc_dir, daemon)
    vs_relay, vs_raw, floor = round_ratios(samples, 2, 1), round_ratios(samples, 2, 0), round_ratios(samples, 1, 0)
    print_table((("raw pyzmq echo (1 hop)", raw), ("bare relay chain (5 hops)", chain), ("mcpd ping (5 hops)", mcpd)))
    print(spread_line("mcpd ping p50 over the relay chain's", vs_relay))
    print("CPU us per sequential ping, mcpd (relay chain): " +
          ", ".join(f"{role} {cpu['mcpd'][role]} ({cpu['relay'][role]})" for role in ROLES))
    print(json.dumps({"rounds": LATENCY_ROUNDS, "noop_p50_ratio_vs_relay": round(vs_relay["median"], 3),
                      "noop_p50_ratio_vs_relay_q1": round(vs_relay["q1"], 3),
                      "noop_p50_ratio_vs_relay_q3": round(vs_relay["q3"], 3),
                      "noop_p50_ratio_vs_raw": round(vs_raw["median"], 3),
                      "floor_p50_ratio_vs_raw": round(floor["median"], 3),
                      "raw_p50_us": round(raw["p50_us"], 1), "relay_p50_us": round(chain["p50_us"], 1),
                      "mcpd_p50_us": round(mcpd["p50_us"], 1), "mcpd_rps": round(mcpd["throughput_rps"]),
                      "cpu_us_per_ping": cpu, "quick": quick, "only": "noop"}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (well under a minute)")
    parser.add_argument("--only", choices=("noop",), help="noop: the ping against the echo and the relay chain alone")
    parser.add_argument("--kernels", default="auto", help="engine.kernels of the plain daemon, whose worker runs the "
                                                          "1-token generate (native-avx2: AVX2 on an AVX-512 machine)")
    args = parser.parse_args()
    count, total, window = (1000, 10000, 128) if args.quick else (10000, 100000, 128)
    if args.only == "noop":
        return noop_only(count, total, window, args.quick)

    raw_endpoint = f"tcp://127.0.0.1:{free_port()}"
    chain_endpoint = f"tcp://127.0.0.1:{free_port()}"
    unix_chain_endpoint = f"tcp://127.0.0.1:{free_port()}"
    ipc_dir = tempfile.mkdtemp(prefix="mcpd-bench-", dir="/tmp")
    helpers = [multiprocessing.get_context("spawn").Process(target=echo_server, args=(raw_endpoint,), daemon=True)]
    helpers[0].start()
    helpers += start_relay_chain(chain_endpoint, ipc_dir)
    helpers += start_unix_relay_chain(unix_chain_endpoint, ipc_dir)
    daemon = shipped_daemon(engine={"kernels": args.kernels})
    secure = traced = traced0 = None
    targets = [(raw_endpoint, None), (chain_endpoint, None), (daemon.endpoint, None), (unix_chain_endpoint, None)]
    try:
        samples, (raw, chain, mcpd, unix_chain) = measure_all(targets, count, total, window)
        secure = shipped_daemon(security={"curve": "on"})
        curve_samples, (plain, curve) = measure_all([(daemon.endpoint, None), (secure.endpoint, secure.curve_keys("bench"))],
                                                count, total, window)
        secure.stop()   # the 1-token figure with no other daemon's processes waking on these cores
        client_us = client_p50_us(daemon.endpoint, count // 4)
        one_token = one_token_ms(daemon.endpoint, count // 4)
        cpu_us = cpu_us_per_ping(daemon, total, window)
        traced, traced0 = traced_daemon(ipc_dir, 1.0), traced_daemon(ipc_dir, 0.0)
        tracing_overhead, ratio0_overhead = tracing_p50_ratios([daemon, traced, traced0], count)
        turn_times = traced_turn_seconds(traced, TURNS)
        traced.stop()   # exports what its processes still hold
        turn_figures = turn_trace_figures(f"{ipc_dir}/spans-1.0.jsonl", turn_times)
    finally:
        for other in (secure, traced, traced0):
            if other is not None:
                other.stop()
                other.cleanup()
        stop_helpers(helpers, ipc_dir, daemon)

    print_table((("raw pyzmq echo (1 hop)", raw), ("bare relay chain (5 hops)", chain),
                 ("relay, internal hops Unix", unix_chain), ("mcpd ping (5 hops)", mcpd),
                 ("mcpd ping, CURVE on", curve)))
    vs_relay = round_ratios(samples, 2, 1)
    print(spread_line("mcpd ping p50 over the relay chain's", vs_relay))
    print(f"mcpd ping with the bundled Client: p50 {client_us:.1f} us")
    print(f"daemon CPU per pipelined ping (front-end + scheduler + worker): {cpu_us:.1f} us")
    one_token_server = one_token - raw["p50_us"] / 1e3
    print(f"1-token generate: p50 {one_token:.2f} ms, of which the server (beyond a raw echo) {one_token_server:.2f} ms")
    print(f"1-token generate p50 with tracing over off: {tracing_overhead:.3f} (every request traced), "
          f"{ratio0_overhead:.3f} (sample_ratio 0)")
    turn = turn_figures
    print(f"a traced context turn: {turn['tracing_turn_spans']} spans in {turn['tracing_turn_processes']} processes; "
          f"the spans on its path add up to {turn['tracing_turn_spans_frac']:.3f} of the client's time "
          f"({turn['tracing_turn_client_ms']} ms), medians of {TURNS} turns")
    figures = {"rounds": LATENCY_ROUNDS,
        "noop_p50_ratio_vs_relay": round(vs_relay["median"], 3),
        "noop_p50_ratio_vs_relay_q1": round(vs_relay["q1"], 3), "noop_p50_ratio_vs_relay_q3": round(vs_relay["q3"], 3),
        "noop_p50_ratio_vs_raw": round(round_ratios(samples, 2, 0)["median"], 3),
        "noop_p99_ratio_vs_raw": round(mcpd["p99_us"] / raw["p99_us"], 3),
        "noop_throughput_frac_of_raw": round(mcpd["throughput_rps"] / raw["throughput_rps"], 3),
        "floor_p50_ratio_vs_raw": round(round_ratios(samples, 1, 0)["median"], 3),
        "floor_throughput_frac_of_raw": round(chain["throughput_rps"] / raw["throughput_rps"], 3),
        "unix_floor_p50_ratio_vs_raw": round(round_ratios(samples, 3, 0)["median"], 3),
        "unix_floor_throughput_frac_of_raw": round(unix_chain["throughput_rps"] / raw["throughput_rps"], 3),
        "raw_p50_us": round(raw["p50_us"], 1), "mcpd_p50_us": round(mcpd["p50_us"], 1),
        "raw_rps": round(raw["throughput_rps"]), "mcpd_rps": round(mcpd["throughput_rps"]),
        "client_p50_us": round(client_us, 1), "mcpd_cpu_us_per_ping": round(cpu_us, 1),
        "curve_p50_ratio_vs_plain": round(round_ratios(curve_samples, 1, 0)["median"], 3),
        "curve_throughput_frac_of_plain": round(curve["throughput_rps"] / plain["throughput_rps"], 3),
        "curve_p50_us": round(curve["p50_us"], 1),
        "one_token_p50_ms": round(one_token, 3), "one_token_server_ms": round(one_token_server, 3),
        "tracing_p50_overhead": round(tracing_overhead, 3),
        "tracing_ratio0_overhead": round(ratio0_overhead, 3), **turn_figures,
        "quick": args.quick, "kernels": args.kernels,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
