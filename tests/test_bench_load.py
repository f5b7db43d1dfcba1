"""What bench/handlers.py's open loop rests on: a request the generator sends late keeps its lag
(its time still runs from its scheduled arrival, and the generator's figures show the lag),
several client processes together send one schedule to the real daemon, each arrival once, their
outcomes merged in schedule order, and the frame sender they use sends what mcpd's client would
and counts a reply as ok only when it is a real result."""
from __future__ import annotations

import asyncio
import functools
import os
import sys
import time
from pathlib import Path

import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from peerkit.client_processes import CLIENT_NICE, ID_SPAN, PREMIUM_NICE, ClientProcesses  # noqa: E402
from peerkit.frame_sender import BAD_RESULT, OK, PRIORITIES, FrameSender  # noqa: E402
from peerkit.handler_targets import TensorInputs  # noqa: E402
from peerkit.load import Uniform, arrivals, generator_figures, send_on_schedule  # noqa: E402
from mcpd.handlers.examples.risk_scorer import RiskScorer  # noqa: E402
from mcpd.protocol import wire  # noqa: E402

SCORER = "mcpd.handlers.examples.risk_scorer:RiskScorer"
STALL_S = 0.2   # the generator's loop is blocked this long by its first send


class StallingTarget:
    """Blocks its caller's event loop on the first request, as a generator with too much to do does."""

    def __init__(self):
        self.stalled = False

    async def infer(self, index: int, priority: str) -> tuple[str, bool]:
        if not self.stalled:
            self.stalled = True
            time.sleep(STALL_S)
        return "ok", False


def test_a_request_the_generator_sends_late_counts_its_lag_and_keeps_its_scheduled_time():
    schedule = [(0.0, 0, "high"), (0.01, 1, "low"), (0.02, 2, "low")]
    outcomes = asyncio.run(send_on_schedule(StallingTarget(), schedule, time.monotonic()))
    assert [o.priority for o in outcomes] == ["high", "low", "low"]
    late = outcomes[1:]
    assert all(o.lag >= STALL_S - 0.02 for o in late)
    assert all(o.seconds >= o.lag for o in late)   # timed from the scheduled arrival, not the send
    figures = generator_figures(outcomes, seconds=0.03)
    assert figures["generator_lag_p99_ms"] >= (STALL_S - 0.02) * 1e3
    assert figures["offered_rps"] == 100.0 and figures["sent_rps"] < figures["offered_rps"]


def test_client_processes_send_one_schedule_together_each_arrival_once(module_daemon):
    daemon = module_daemon(**{"models.risk": {}, "models.risk.versions.v1": {"handler": SCORER}})
    make_sender = functools.partial(FrameSender, daemon.endpoint, "risk", TensorInputs(RiskScorer.inputs), 10_000)
    pick = Uniform(16)
    expected = arrivals(200.0, 0.5, pick, seed=3, high_frac=0.5)
    with ClientProcesses(make_sender, 2, prepare=16) as processes:
        outcomes, cpu_s = asyncio.run(processes.open_loop(200.0, 0.5, pick, seed=3, high_frac=0.5))
        capacity = asyncio.run(processes.closed_loop(4, 0.3, pick, seed=4))
    assert [(o.scheduled_s, o.priority) for o in outcomes] == [(at, priority) for at, _, priority in expected]
    assert all(o.outcome == "ok" for o in outcomes)
    assert all(o.seconds >= o.lag >= 0 for o in outcomes)   # answered after it was sent, sent when due or later
    assert cpu_s > 0 and capacity > 0


def test_a_premium_process_sends_every_high_arrival_of_an_open_loop(module_daemon):
    daemon = module_daemon(**{"models.risk": {}, "models.risk.versions.v1": {"handler": SCORER}})
    make_sender = functools.partial(FrameSender, daemon.endpoint, "risk", TensorInputs(RiskScorer.inputs), 10_000)
    pick = Uniform(16)
    expected = arrivals(200.0, 0.5, pick, seed=5, high_frac=0.3)
    with ClientProcesses(make_sender, 2, prepare=16,
                         make_premium=functools.partial(make_sender, tenant="premium")) as processes:
        outcomes, _ = asyncio.run(processes.open_loop(200.0, 0.5, pick, seed=5, high_frac=0.3))
        capacity = asyncio.run(processes.closed_loop(4, 0.3, pick, seed=6))
        niceness = [os.getpriority(os.PRIO_PROCESS, process.pid) for process in processes.processes]
    # the flood yields the cores to the daemon, as clients elsewhere would; the premium one does not wait behind it
    assert niceness == [CLIENT_NICE, CLIENT_NICE, PREMIUM_NICE]
    assert [(o.scheduled_s, o.priority) for o in outcomes] == [(at, priority) for at, _, priority in expected]
    assert all(o.outcome == "ok" for o in outcomes) and capacity > 0
    premium = {o.request_id // ID_SPAN for o in outcomes if o.priority == "high"}
    flood = {o.request_id // ID_SPAN for o in outcomes if o.priority == "low"}
    assert premium == {2} and flood == {0, 1}   # the processes' ids are ID_SPAN apart, the premium one's last


def test_a_prebuilt_header_with_its_id_patched_is_the_header_mcpds_client_encodes_with_its_tenant():
    inputs = TensorInputs(RiskScorer.inputs)
    sender = FrameSender("tcp://127.0.0.1:1", "risk", inputs, 5_000)
    sender.prepare(3)
    described, frames = inputs.frames(2)
    for request_id in (0, 1, 300, 2**32 - 2):
        for code, priority in enumerate(PRIORITIES):
            before, after = sender.templates[2][code]
            patched = before + request_id.to_bytes(4, "big") + after
            expected = wire.encode_request("infer", request_id, {"model": "risk", "cache": True, "inputs": described},
                                           priority=priority, timeout_ms=5_000)
            assert msgpack.unpackb(patched) == msgpack.unpackb(expected)
    tenant = FrameSender("tcp://127.0.0.1:1", "risk", inputs, 5_000, tenant="premium")
    tenant.prepare(1)
    before, after = tenant.templates[0][PRIORITIES.index("high")]
    assert msgpack.unpackb(before + (5).to_bytes(4, "big") + after)["tenant"] == "premium"
    assert sender.payloads[2] == frames


def test_a_reply_counts_as_ok_only_when_it_is_a_real_result():
    sender = FrameSender("tcp://127.0.0.1:1", "risk", TensorInputs(RiskScorer.inputs), 5_000)
    result = {"outputs": [{"name": "score", "datatype": "FP32", "shape": [1]}]}
    assert sender._outcome({"kind": "ok", "result": result}, [np.float32(0.5).tobytes()]) == OK
    assert sender._outcome({"kind": "ok", "result": result}, []) == BAD_RESULT          # no frame for its output
    assert sender._outcome({"kind": "ok", "result": result}, [b"\0" * 3]) == BAD_RESULT  # a frame of the wrong size
    assert sender._outcome({"kind": "ok", "result": {}}, []) == BAD_RESULT              # no outputs at all
    assert sender._outcome({"kind": "ok"}, []) == BAD_RESULT
    refused = sender._outcome({"kind": "error", "code": "OVERLOADED"}, [])
    assert sender.codes[refused] == "OVERLOADED"


def test_each_arrival_gets_its_own_reply_and_an_error_reply_its_code(module_daemon):
    daemon = module_daemon(**{"models.risk": {}, "models.risk.versions.v1": {"handler": SCORER}})
    inputs = TensorInputs(RiskScorer.inputs)
    for model, expected in (("risk", "ok"), ("no-such-model", "UNKNOWN_MODEL")):
        sender = FrameSender(daemon.endpoint, model, inputs, 10_000)
        sender.prepare(4)
        sender.connect()
        try:
            at = np.linspace(0.0, 0.05, 20)
            run = sender.open_loop(at, np.arange(20) % 4, np.arange(20, dtype=np.int8) % 3, time.monotonic(), 10)
        finally:
            sender.close()
        assert [run["codes"][code] for code in run["outcome"]] == [expected] * 20
        assert np.all(run["replied"] >= run["sent"])
