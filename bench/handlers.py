"""Handler models (a risk scorer, a text classifier) served by mcpd against LitServe and MLServer
serving the same Handler on this machine, and mcpd's own batching, priorities and result cache.

    .venv/bin/python bench/handlers.py --setup     # once, outside CI: LitServe's and MLServer's venvs
    .venv/bin/python bench/handlers.py [--quick] [--models risk,text] [--peers litserve,mlserver] [--threads 1] [--cache-dir DIR]
    .venv/bin/python bench/handlers.py --burst-only [--quick] [--burst-clients 2] [--burst-spans 0.2] [--burst-control]
    python bench/handlers.py --device cuda --peers '' [--quick]   # on a GPU: mcpd's batching there

With --device cuda mcpd's workers and the batching ceiling's model run on the GPU, each model
batching up to its gpu_max_batch_size; the peers' venvs run torch on the CPU, so they are left out.

Every server runs the same code: the example Handler through its preprocess, predict on the
batch, postprocess (peerkit/handler_runner.py in the peers, HandlerCore in mcpd), each with its
own batching on at the same size and delay. Before measuring, each server's outputs for a few
inputs must equal the handler's own in this process (`outputs_match`). Systems:

  mcpd       the `infer` op over ZeroMQ, raw payload frames
  mcpd-http  the same daemon through its Open Inference Protocol (KServe v2) route, JSON bodies
  litserve   LitServe, max_batch_size / batch_timeout, the same JSON at /v2/models/<m>/infer
  mlserver   MLServer, adaptive batching, the same JSON

Figures (each a search: open-loop Poisson arrivals at rates bisected between 5% and 120% of the
closed-loop capacity, the top doubled while no rate has failed and one within 25% of it held (a
server may hold an open loop above its closed-loop reading), each rate tried twice before it
counts as failed; a rate is held when every request is answered ok and the p99 is <= 50 ms.
Every system gets the same search, run Sizes.rounds times one after another on the same warmed
server, and its held rate is the best round's: a neighbour's burst on a shared machine can fail
both tries of a rate a system holds, capping that round's bisection below it, so one round can
under-read a system by half; `rounds_rps` keeps each round's):
  handler_<model>_rps_ratio_vs_best_peer       mcpd's held rate over the best peer's (> 1: mcpd leads)
  handler_<model>_http_rps_ratio_vs_best_peer  the same for mcpd-http (the peers' own transport)
  batching_speedup    text classifier: mcpd's held rate with batching over max_batch_size = 0
                      (batching_speedup_<model> for each model: the risk MLP's predict is too
                      cheap for batching to matter, BATCHING_MODEL says why)
  batching_ceiling_<model>   the model's own gain from batching on this CPU, in this process:
                      predict()'s time per row at batch 1 over at max_batch_size (peerkit/
                      batching_ceiling.py); batching_speedup_<model> cannot pass it
  batching_ceiling_frac   batching_speedup over its model's batching_ceiling: what the daemon keeps
                      of the model's own gain. The CPU's target; batching_speedup's >= 5 needs a
                      device where a batch costs about what a row does (a GPU)
  handler_high_p99_ratio   risk scorer, 10% `high` / 90% `low` at 2x the closed-loop capacity:
                      high's p99 over its p99 alone at 0.2x, the median of three rounds of both
                      (burst.rounds_high_p99_ratio keeps each); handler_unanswered (all rounds) must
                      be 0. The lows offered by --burst-clients processes, the highs by one more on its own
                      connection as another tenant's client (burst.load says so); generator_lag_p99_ms
                      says how late they sent (a note when later than high's idle p99).
                      --burst-control runs it with priorities off (FIFO, no edge shedding): far over 2
                      burst.burst_high_p99_by_send_time: high's p99 by when in the burst it was sent
                      (finer at the start, where a backlog builds before shedding), and the first low refused;
                      burst.core_stalls: how often each core stopped running a spinning process
                      before the burst (peerkit/core_stalls.py), the machine's floor under idle p99
  cache_hit_rate, cache_rps_ratio   text classifier, a Zipf(1.1) stream over 100k distinct
                      inputs, the cache warmed at start from a file of the 20k most frequent:
                      the share answered from the cache, and the held rate over the cache off
  context_bytes_ratio client bytes per request sending a profile each time over naming it as a
                      context input (null with a note while contexts-as-inputs is not served)

The last line is one JSON object; the machine (CPU, ISA) is in it. A peer not installed or not
starting, or an example handler this tree lacks, is named with the reason ("missing") and its
figures are null.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import figures as kept_figures
from mcpd.client import Client
from mcpd.handlers.handler import load_handler
from peerkit import checkpoints, handler_servers, servers
from peerkit.batching_ceiling import batching_ceiling
from peerkit.core_stalls import core_stalls
from peerkit.handler_servers import Placement
from peerkit.burst_stages import BurstStages, high_p99_by_send_time, high_spans_ms, request_parts_ms
from peerkit.handler_runner import HandlerRunner
from peerkit.handler_targets import DEADLINE_MS, HttpV2, McpdZmq, TensorInputs
from peerkit.client_processes import CLIENT_NICE, PREMIUM_NICE, ClientProcesses
from peerkit.frame_sender import FrameSender
from peerkit.load import Outcome, Uniform, closed_loop, freeze_what_lives, generator_figures, max_rate, open_loop, p99_ms

P99_LIMIT_MS = 50.0
CAPACITY_CLIENTS = 64
WARM_UP_S = 1.0
CHECKED_INPUTS = 8
INPUT_POOL = 2048   # distinct inputs of a search (no cache is on there: repeats cost what new ones do)
# batching_speedup's model: the risk MLP's predict takes microseconds a batch, so the daemon's
# per-request path bounds it batched or not (its speedup is reported beside, as batching_speedup_risk).
BATCHING_MODEL = "text"
CONTEXT_ID, CONTEXT_REQUESTS = "profile-0", 16
ZIPF_S, ZIPF_INPUTS, WARM_INPUTS = 1.1, 100_000, 20_000   # the 20k most frequent: 93% of the draws
CACHE_BYTES = 256 << 20
WARM_START_S = 900   # the warm-up runs 20k texts through the model before the daemon is ready
CEILING_INPUTS = 256   # rows predict() runs at batch 1 and in full batches for the batching ceiling
BURST_MODEL = "risk"
STALL_PROBE_S = 2.0   # each core spun this long for burst.core_stalls
BURST_CLIENTS = 2    # processes offering the burst: one Python process cannot send 2x mcpd's capacity on time
PREMIUM_TENANT = "premium"
BURST_LOAD = ("open-loop Poisson arrivals; the capacity closed-loop from the flood's processes; every high "
              f"request from one more process, its own connection, tenant {PREMIUM_TENANT!r} (idle: it alone), "
              "the lows split over the flood's processes; replies stamped as the socket yields them; the flood's "
              f"processes at nice {CLIENT_NICE}, below the daemon's (clients are other machines in deployments), "
              f"the premium one at nice {PREMIUM_NICE}, the daemon's (it must not queue for a core behind it)")
# The control: high waits as low does (one FIFO, no edge shedding). Its ratio must be far over 2,
# or the figure does not measure what the daemon does for high.
CONTROL_SCHEDULER = {"policy": "fifo", "shed_wait_ms": 0.0}


@dataclass(frozen=True)
class Model:
    handler: str
    settings: dict
    batching: dict    # every server's: the most rows a predict takes, and how long the first waits
    length_bins: tuple[int, ...] = ()   # mcpd's own (the peers have none)
    gpu_max_batch_size: int = 64   # on a GPU, where a batch costs about what a row does


MODELS = {
    "risk": Model("mcpd.handlers.examples.risk_scorer:RiskScorer", {"hidden": 64, "seed": 0},
                  {"max_batch_size": 64, "max_queue_delay_ms": 2.0}),
    # A batch of 64 texts takes longer than the 50 ms p99 on one busy core: 8 rows hold it.
    "text": Model("mcpd.handlers.examples.text_classifier:TextClassifier", {"seed": 0},
                  {"max_batch_size": 8, "max_queue_delay_ms": 2.0}, length_bins=(16, 32, 48, 64, 96, 128)),
}


@dataclass(frozen=True)
class Sizes:
    capacity_s: float
    probes: int
    probe_s: float
    burst_s: float
    rounds: int = 2   # searches of a system; its held rate is the best of them
    burst_rounds: int = 3   # idle-and-burst rounds of the priority burst; its figures are the median round's


# Six probes: the search's steps are then about 5% of the rate (four left 22%, and a ratio of two
# held rates, such as batching_ceiling_frac, could move by that much on one step).
QUICK, FULL = Sizes(1.5, 6, 1.5, 4.0), Sizes(4.0, 7, 5.0, 15.0)


def mcpd_batching(model: Model, device: str = "cpu") -> dict:
    batching = dict(model.batching)
    if device != "cpu":
        batching["max_batch_size"] = model.gpu_max_batch_size
    if model.length_bins:
        batching["length_bins"] = list(model.length_bins)
    return batching


async def search(target, sizes: Sizes) -> dict:
    """The closed-loop capacity and the held rate, the best of `sizes.rounds` searches (each with
    its own arrivals); requests draw from INPUT_POOL inputs encoded beforehand (the client's
    encoding must not be timed)."""
    target.prepare(INPUT_POOL)
    freeze_what_lives()
    pick = Uniform(INPUT_POOL)
    await closed_loop(target, CAPACITY_CLIENTS, WARM_UP_S, pick, seed=98)   # first calls allocate, threads settle
    capacity = await closed_loop(target, CAPACITY_CLIENTS, sizes.capacity_s, pick, seed=99)
    rounds = [await max_rate(target, capacity, sizes.probes, sizes.probe_s, P99_LIMIT_MS, pick, seed=1000 * at)
              for at in range(sizes.rounds)]
    return {"capacity_rps": round(capacity, 1), "rps": round(max(found["rps"] for found in rounds), 1),
            "rounds_rps": [round(found["rps"], 1) for found in rounds], "probes": [found["probes"] for found in rounds]}


async def outputs_match(target, inputs: TensorInputs, reference: list[dict]) -> bool:
    for index, expected in enumerate(reference):
        got = await target.outputs(index)
        if set(got) != set(expected) or not all(np.allclose(got[n], expected[n], rtol=1e-3, atol=1e-4) for n in got):
            return False
    return True


# -- the systems ----------------------------------------------------------------------------------

async def measure_mcpd(name: str, model: Model, inputs: TensorInputs, reference, sizes: Sizes, placement: Placement,
                       burst_clients: int | None) -> dict:
    """mcpd over ZeroMQ and over its KServe route; with `burst_clients`, the priority burst (sent
    by that many processes) and the context's bytes too."""
    server = handler_servers.McpdServer(name, model.handler, model.settings, mcpd_batching(model, placement.device),
                                        placement)
    try:   # stop() in finally also ends a daemon that did not get ready in time
        server.start()
        zmq_target = McpdZmq("mcpd", server.endpoint, name, inputs)
        http_target = HttpV2("mcpd-http", server.http_port, f"/v2/models/{name}/infer", inputs)
        found = {"mcpd": {**await search(zmq_target, sizes),
                          "outputs_match": await outputs_match(zmq_target, inputs, reference)}}
        try:
            found["mcpd-http"] = {"outputs_match": await outputs_match(http_target, inputs, reference),
                                  **await search(http_target, sizes)}
        except (RuntimeError, OSError) as e:
            found["mcpd-http"] = {"missing": f"{type(e).__name__}: {e}"[:300]}
        # Closed first: the burst's processes connect from the same address, within the daemon's per-address cap.
        await zmq_target.close()
        await http_target.close()
        if burst_clients:
            found["burst"] = await priority_burst(server, name, inputs, sizes, burst_clients)
            found["context"] = await context_bytes(server.endpoint, name, inputs)
        return found
    finally:
        server.stop()


async def measure_peer(peer: str, cache_dir: Path, threads: int, name: str, model: Model, inputs: TensorInputs,
                       reference, sizes: Sizes) -> dict:
    reason = servers.missing_reason(cache_dir, peer, Path(), "float32")
    if reason:
        return {"missing": reason}
    try:
        server = handler_servers.PEER_SERVERS[peer](cache_dir, name, model.handler, model.settings, model.batching,
                                                    threads).start()
    except RuntimeError as e:
        return {"missing": f"did not start: {e}"}
    try:
        target = HttpV2(peer, server.port, f"/v2/models/{name}/infer", inputs)
        found = {"outputs_match": await outputs_match(target, inputs, reference), **await search(target, sizes)}
        await target.close()
        return found
    finally:
        server.stop()


async def batching_off(name: str, model: Model, inputs: TensorInputs, sizes: Sizes, placement: Placement) -> dict:
    server = handler_servers.McpdServer(name, model.handler, model.settings, {"max_batch_size": 0}, placement)
    try:
        server.start()
        target = McpdZmq("mcpd", server.endpoint, name, inputs)
        found = await search(target, sizes)
        await target.close()
        return found
    finally:
        server.stop()


@dataclass
class BurstPhase:
    """One open loop of the burst: its outcomes, and its start (monotonic) their times count from."""
    outcomes: list[Outcome]
    started: float


async def priority_burst(server: handler_servers.McpdServer, name: str, inputs: TensorInputs, sizes: Sizes,
                         clients: int, phases: dict[str, BurstPhase] | None = None) -> dict:
    """The closed-loop capacity, then `sizes.burst_rounds` rounds of high's p99 alone at 0.2x it
    and in a 10% high / 90% low burst at 2x: the capacity and the lows offered by `clients`
    processes (one cannot send 2x a fast server's rate on time, nor always saturate it), every
    high by one more on its own connection, as tenant PREMIUM_TENANT; the generator's own lag is
    reported beside, and high's p99 from the send as well as from the scheduled arrival. The
    figures are the median round's (by its ratio; every round's ratio is kept): one round of a
    few seconds on a shared machine reads anything from under 2x to many times that, as a
    neighbour's moment of load falls. `phases`, when given, gets the median round's "idle" and
    "burst" runs."""
    stalls = core_stalls(STALL_PROBE_S)   # before any client process: the machine's own floor
    pick = Uniform(INPUT_POOL)
    make_sender = functools.partial(FrameSender, server.endpoint, name, inputs, DEADLINE_MS)
    make_premium = functools.partial(make_sender, tenant=PREMIUM_TENANT)
    with ClientProcesses(make_sender, clients, INPUT_POOL, make_premium) as processes:
        await processes.closed_loop(CAPACITY_CLIENTS, WARM_UP_S, pick, seed=98)
        capacity = await processes.closed_loop(CAPACITY_CLIENTS, sizes.capacity_s, pick, seed=99)
        rounds = [await burst_round(server, processes, capacity, pick, sizes.burst_s, seed=10 * at)
                  for at in range(sizes.burst_rounds)]
    median, round_phases = median_round(rounds)
    if phases is not None:
        phases.update(round_phases)
    return {"capacity_rps": round(capacity, 1), "clients": clients, "load": BURST_LOAD, **median,
            "rounds_high_p99_ratio": [found["high_p99_ratio"] for found, _ in rounds],
            "unanswered": sum(found["unanswered"] for found, _ in rounds), "core_stalls": stalls}


async def burst_round(server: handler_servers.McpdServer, processes: ClientProcesses, capacity: float, pick,
                      burst_s: float, seed: int) -> tuple[dict, dict[str, BurstPhase]]:
    """One round: high alone at 0.2x capacity, then the burst at 2x; its figures and phases."""
    idle, idle_cpu_s = await processes.open_loop(0.2 * capacity, burst_s, pick, seed=seed + 7, high_frac=1.0)
    idle_phase = BurstPhase(idle, processes.started)
    stages = BurstStages(server.daemon, processes.pids())
    stages.start()
    started = time.perf_counter()
    burst, burst_cpu_s = await processes.open_loop(2.0 * capacity, burst_s, pick, seed=seed + 8, high_frac=0.1)
    burst_phase = BurstPhase(burst, processes.started)
    answered_s = time.perf_counter() - started
    counts: dict[str, dict[str, int]] = {}
    for outcome in burst:
        by_class = counts.setdefault(outcome.priority, {})
        by_class[outcome.outcome] = by_class.get(outcome.outcome, 0) + 1
    stage_figures = stages.figures(requests_reached(server.daemon, len(burst), counts))
    idle_p99, burst_p99 = p99_ms(idle, "high"), p99_ms(burst, "high")
    return {"idle_high_p99_ms": round(idle_p99, 2), "burst_high_p99_ms": round(burst_p99, 2),
            "high_p99_ratio": ratio(burst_p99, idle_p99, 3),
            "burst_high_p99_from_send_ms": round(p99_ms(from_send(burst), "high"), 2),
            "burst_high_p99_by_send_time": high_p99_by_send_time(burst, burst_s),
            "scheduler_high_queue_p99_ms": stage_figures["scheduler_queue_p99_ms"].get("high"),
            "stages": stage_figures,
            "idle": generator_figures(idle, burst_s, idle_cpu_s),
            "generator": generator_figures(burst, burst_s, burst_cpu_s),
            "burst_s": burst_s, "last_answer_s": round(answered_s, 1),
            "unanswered": sum(o.outcome == "unanswered" for o in idle + burst), "codes": counts}, \
        {"idle": idle_phase, "burst": burst_phase}


def median_round(rounds: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """The round whose ratio is the median (the higher of the middle two for an even count)."""
    ranked = sorted(rounds, key=lambda found: found[0]["high_p99_ratio"])
    return ranked[len(ranked) // 2]


def requests_reached(daemon, offered: int, counts: dict[str, dict[str, int]]) -> dict[str, int]:
    """How many of the burst's requests each role handled: the front-end all, the scheduler and
    the worker those past the edge's shedding (answered ok, or refused by the scheduler)."""
    refused = sum(sum(errors.values()) for errors in daemon.status().get("scheduler", {}).get("errors", {}).values())
    past_edge = sum(by_class.get("ok", 0) for by_class in counts.values()) + refused
    return {"frontend": offered, "scheduler": past_edge, "worker": past_edge}


def from_send(outcomes: list[Outcome]) -> list[Outcome]:
    """The outcomes timed from when the generator really sent them: the server's part, and the
    generator's own reading of the replies."""
    return [dataclasses.replace(o, seconds=o.seconds - o.lag) for o in outcomes]


# -- the cache ------------------------------------------------------------------------------------

def zipf_pick(count: int, s: float):
    """Input index by a Zipf(s) draw over `count` inputs (index 0 the most frequent)."""
    cdf = np.cumsum(np.arange(1, count + 1, dtype=np.float64) ** -s)
    cdf /= cdf[-1]
    return lambda rng: min(int(np.searchsorted(cdf, rng.random())), count - 1)


def warmup_file(inputs: TensorInputs, count: int, directory: Path) -> Path:
    """The cache's warm-up file: the `count` most frequent inputs as `infer` would send them."""
    import msgpack
    entries = []
    for index in range(count):
        header, frames = inputs.frames(index)
        entries.append({"inputs": header, "payload": frames})
    path = directory / "cache-warmup.msgpack"
    path.write_bytes(msgpack.packb(entries))
    return path


async def cache_run(name: str, model: Model, sizes: Sizes, placement: Placement, cache_on: bool) -> dict:
    """The Zipf stream on a daemon with the cache on (warmed from a file) or off."""
    inputs = TensorInputs(load_handler(model.handler).inputs, seed=1)
    with tempfile.TemporaryDirectory(prefix="mcpd-bench-cache-") as directory:
        cache = {"max_bytes": CACHE_BYTES, "warmup": str(warmup_file(inputs, WARM_INPUTS, Path(directory)))}
        server = handler_servers.McpdServer(name, model.handler, model.settings, mcpd_batching(model, placement.device),
                                            placement, cache=cache if cache_on else None)
        try:
            server.start_within(WARM_START_S)
            target = McpdZmq("mcpd", server.endpoint, name, inputs, cache=cache_on)
            found = await zipf_stream(target, sizes)
            await target.close()
            return found
        finally:
            server.stop()


async def zipf_stream(target: McpdZmq, sizes: Sizes) -> dict:
    """The held rate, and the share answered from the cache at half the capacity."""
    target.prepare(ZIPF_INPUTS)
    freeze_what_lives()
    pick = zipf_pick(ZIPF_INPUTS, ZIPF_S)
    await closed_loop(target, CAPACITY_CLIENTS, WARM_UP_S, pick, seed=98)
    capacity = await closed_loop(target, CAPACITY_CLIENTS, sizes.capacity_s, pick, seed=99)
    outcomes = await open_loop(target, 0.5 * capacity, sizes.probe_s, pick, seed=5)
    found = await max_rate(target, capacity, sizes.probes, sizes.probe_s, P99_LIMIT_MS, pick)
    answered = [o for o in outcomes if o.outcome == "ok"]
    return {"capacity_rps": round(capacity, 1), "rps": round(found["rps"], 1), "probes": found["probes"],
            "hit_rate": round(sum(o.cached for o in answered) / max(1, len(answered)), 4)}


# -- figures --------------------------------------------------------------------------------------

def rps_ratio(systems: dict, ours: str) -> float | None:
    """`ours`'s held rate over the best peer's (> 1: mcpd leads); None when no peer ran."""
    peers = [found["rps"] for name, found in systems.items() if name in handler_servers.HANDLER_PEERS and "rps" in found]
    if not peers or "rps" not in systems.get(ours, {}):
        return None
    return round(systems[ours]["rps"] / max(peers), 3) if max(peers) else None


def ratio(numerator, denominator, digits: int = 2) -> float | None:
    """numerator / denominator; None when either was not measured (or the denominator is 0)."""
    return round(numerator / denominator, digits) if numerator is not None and denominator else None


def figures_of(measured: dict) -> dict:
    """The figures with targets; a part that did not run (a handler not shipped yet) gives None."""
    out = {}
    for name in MODELS:
        systems = measured["models"].get(name, {})
        out[f"handler_{name}_rps_ratio_vs_best_peer"] = rps_ratio(systems, "mcpd")
        out[f"handler_{name}_http_rps_ratio_vs_best_peer"] = rps_ratio(systems, "mcpd-http")
        out[f"batching_speedup_{name}"] = ratio(systems.get("mcpd", {}).get("rps"),
                                                systems.get("mcpd-unbatched", {}).get("rps"))
        out[f"batching_ceiling_{name}"] = systems.get("model-alone", {}).get("ceiling")
    out["batching_speedup"] = out[f"batching_speedup_{BATCHING_MODEL}"]
    out["batching_ceiling_frac"] = ratio(out["batching_speedup"], out[f"batching_ceiling_{BATCHING_MODEL}"])
    burst = measured.get("burst", {})
    out["handler_high_p99_ratio"] = burst.get("high_p99_ratio")
    out["handler_unanswered"] = burst.get("unanswered")
    lag = out["generator_lag_p99_ms"] = burst.get("generator", {}).get("generator_lag_p99_ms")
    if lag is not None and lag > burst["idle_high_p99_ms"]:
        out["handler_high_p99_note"] = ("the generator sent later than high's idle p99: the ratio counts the "
                                        "generator's lag too (burst_high_p99_from_send_ms leaves the sending lag out)")
    cache_on, cache_off = measured.get("cache_on", {}), measured.get("cache_off", {})
    out["cache_hit_rate"] = cache_on.get("hit_rate")
    out["cache_rps_ratio"] = ratio(cache_on.get("rps"), cache_off.get("rps"))
    if cache_on.get("hit_rate") == 0:
        out["cache_note"] = "no reply was marked cached: the hit rate and the ratio measure no cache"
    out.update(measured.get("context", {"context_bytes_ratio": None}))
    return out


async def context_bytes(endpoint: str, model: str, inputs: TensorInputs) -> dict:
    """Client bytes per request: a profile (input 0) sent each time against named as a context's
    fields (infer's context_inputs), both ways answered alike."""
    profile = inputs.arrays(0)
    with Client(endpoint) as client:
        context = client.context(CONTEXT_ID)
        for name, array in profile.items():
            context[name] = array[0]   # a field is one row: the daemon adds the batch dim
        context.sync()
    resend = McpdZmq("resend", endpoint, model, inputs)
    named = McpdZmq("context", endpoint, model, TensorInputs({}),
                    extra={"context": CONTEXT_ID, "context_inputs": {name: name for name in profile}})
    try:
        for _ in range(CONTEXT_REQUESTS):
            sent, read = await resend.outputs(0), await named.outputs(0)
    except RuntimeError as e:
        return {"context_bytes_ratio": None, "context_note": f"contexts as inputs refused: {e}"[:300]}
    finally:
        await resend.close()
        await named.close()
    return {"context_bytes_ratio": round(resend.sent_bytes / named.sent_bytes, 2),
            "context_bytes_per_request": {"resend": resend.sent_bytes // CONTEXT_REQUESTS,
                                          "context": named.sent_bytes // CONTEXT_REQUESTS},
            "context_outputs_match": all(np.array_equal(sent[n], read[n]) for n in sent)}


# -- the run --------------------------------------------------------------------------------------

async def run(args) -> dict:
    sizes = QUICK if args.quick else FULL
    if args.burst_only:
        return await burst_only(args, sizes)
    measured = {"models": {}, "missing": {}}
    for name, model in MODELS.items():
        if name not in args.models:
            continue
        try:
            inputs = TensorInputs(load_handler(model.handler).inputs)
        except ValueError as e:   # an example not shipped in this tree: its figures are None
            measured["missing"][name] = str(e)
            continue
        measured["models"][name] = await measure_model(args, sizes, name, model, inputs, measured)
    if "text" in args.models and "text" not in measured["missing"]:
        print("cache: on, then off ...", flush=True)
        placement = Placement(args.threads, args.device)
        measured["cache_on"] = await cache_run("text", MODELS["text"], sizes, placement, cache_on=True)
        measured["cache_off"] = await cache_run("text", MODELS["text"], sizes, placement, cache_on=False)
    return measured


async def burst_only(args, sizes: Sizes) -> dict:
    """The priority burst alone; with --burst-spans, high's time split span by span as well."""
    model = MODELS[BURST_MODEL]
    inputs = TensorInputs(load_handler(model.handler).inputs)
    spans = Path(tempfile.mkdtemp(prefix="burst-spans-")) / "spans.jsonl" if args.burst_spans else None
    tracing = {"enabled": True, "exporter": "file", "path": str(spans), "sample_ratio": args.burst_spans} if spans else None
    server = handler_servers.McpdServer(BURST_MODEL, model.handler, model.settings, mcpd_batching(model, args.device),
                                        Placement(args.threads, args.device), tracing=tracing, scheduler=CONTROL_SCHEDULER if args.burst_control else None)
    phases: dict[str, BurstPhase] = {}
    try:
        server.start()
        burst = await priority_burst(server, BURST_MODEL, inputs, sizes, args.burst_clients, phases)
    finally:
        server.stop()   # the processes' last spans are written as they stop
    if spans:
        stages = burst["stages"]
        stages["high_spans_ms"] = high_spans_ms(spans, stages["started_ns"])
        stages["high_parts_ms"] = {name: request_parts_ms(spans, phase.outcomes, phase.started, stages["offset_ns"],
                                                          "high") for name, phase in phases.items()}
        stages["spans_file"] = str(spans)
    burst["scheduler"] = CONTROL_SCHEDULER if args.burst_control else "as shipped"
    return {"models": {}, "missing": {}, "burst": burst}


async def measure_model(args, sizes: Sizes, name: str, model: Model, inputs: TensorInputs, measured: dict) -> dict:
    """Every system on one model; the risk scorer's run keeps the burst and the context's bytes."""
    placement = Placement(args.threads, args.device)
    runner = HandlerRunner(model.handler, model.settings, args.device)
    reference = [runner.run([inputs.arrays(i)])[0] for i in range(CHECKED_INPUTS)]
    print(f"{name}: the model's own batching ceiling ...", flush=True)
    found_ceiling = batching_ceiling(runner, [inputs.arrays(i) for i in range(CEILING_INPUTS)],
                                     mcpd_batching(model, args.device)["max_batch_size"], args.threads)
    print(f"{name}: mcpd ...", flush=True)
    found = await measure_mcpd(name, model, inputs, reference, sizes, placement,
                               args.burst_clients if name == BURST_MODEL else None)
    if name == BURST_MODEL:
        measured["burst"], measured["context"] = found.pop("burst"), found.pop("context")
    found["model-alone"] = found_ceiling
    print(f"{name}: mcpd, batching off ...", flush=True)
    found["mcpd-unbatched"] = await batching_off(name, model, inputs, sizes, placement)
    for peer in args.peers:
        print(f"{name}: {peer} ...", flush=True)
        found[peer] = await measure_peer(peer, args.cache_dir, args.threads, name, model, inputs, reference, sizes)
    print(json.dumps({name: {system: {k: v for k, v in f.items() if k != "probes"} for system, f in found.items()}}),
          flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="store_true", help="install LitServe and MLServer in their venvs, then exit")
    parser.add_argument("--quick", action="store_true", help="short searches (7-12 minutes in all: every server still starts)")
    parser.add_argument("--peers", default=",".join(handler_servers.HANDLER_PEERS), help="comma-separated subset")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of the models")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of every server (mcpd: workers.threads); 1: the best on a busy 2-core machine")
    parser.add_argument("--cache-dir", type=Path, default=checkpoints.DEFAULT_CACHE)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where mcpd's workers and the batching ceiling run the models; cuda leaves the peers out")
    parser.add_argument("--burst-only", action="store_true", help="only the priority burst (its capacity measured first)")
    parser.add_argument("--burst-clients", type=int, default=BURST_CLIENTS,
                        help="client processes that offer the burst together (each its own socket)")
    parser.add_argument("--burst-spans", type=float, default=0.0,
                        help="with --burst-only: the share of requests the daemon traces, and high's time split by "
                             "span in burst.stages.high_spans_ms (tracing costs the daemon: not for kept figures)")
    parser.add_argument("--burst-control", action="store_true",
                        help="with --burst-only: the daemon's scheduler FIFO with edge shedding off, where high waits "
                             "as low does: the ratio must be far over 2, or the burst does not measure priorities")
    args = parser.parse_args()
    args.peers = servers.chosen(parser, args.peers, handler_servers.HANDLER_PEERS)
    args.models = [name for name in args.models.split(",") if name]
    if not 0.0 <= args.burst_spans <= 1.0:
        parser.error(f"--burst-spans {args.burst_spans}: a share of requests, 0 to 1")
    check_device(parser, args.device, args.peers)
    if set(args.models) - set(MODELS):
        parser.error(f"unknown models {sorted(set(args.models) - set(MODELS))}; known: {', '.join(MODELS)}")
    if args.setup:
        setup(args.cache_dir)
        return
    load_before = round(os.getloadavg()[0], 2)
    measured = asyncio.run(run(args))
    print(json.dumps({**figures_of(measured), **measured,
                      "versions": {peer: servers.version(args.cache_dir, peer) for peer in args.peers},
                      "machine": kept_figures.machine(), "load_avg": [load_before, round(os.getloadavg()[0], 2)],
                      "p99_limit_ms": P99_LIMIT_MS,
                      "batching": {name: mcpd_batching(model, args.device) for name, model in MODELS.items()},
                      "threads": args.threads, "device": args.device,
                      "quick": args.quick}))


def check_device(parser: argparse.ArgumentParser, device: str, peers: list[str]) -> None:
    """--device cuda needs no peer (their venvs' torch runs on the CPU) and a GPU torch sees."""
    if device == "cpu":
        return
    if peers:
        parser.error(f"--device {device}: the peers ({', '.join(peers)}) run on the CPU; add --peers ''")
    import torch

    if not torch.cuda.is_available():
        parser.error(f"--device {device}: torch sees no CUDA device on this machine")


def setup(cache_dir: Path) -> None:
    """The peers' venvs (niced; each step skipped when done); one failing does not stop the other."""
    os.nice(19)
    for peer in handler_servers.HANDLER_PEERS:
        try:
            servers.install(cache_dir, peer)
            print(f"{peer}: installed in {servers.venv_dir(cache_dir, peer)}")
        except RuntimeError as e:
            print(f"{peer}: install failed: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
