"""What bench/handlers.py's open loop rests on: a request the generator sends late keeps its lag
(its time still runs from its scheduled arrival, and the generator's figures show the lag), and
several client processes together send one schedule to the real daemon, each arrival once, their
outcomes merged in schedule order."""
from __future__ import annotations

import asyncio
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from peerkit.client_processes import ClientProcesses  # noqa: E402
from peerkit.handler_targets import McpdZmq, TensorInputs  # noqa: E402
from peerkit.load import arrivals, generator_figures, send_on_schedule  # noqa: E402
from mcpd.handlers.examples.risk_scorer import RiskScorer  # noqa: E402

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
    inputs = TensorInputs(RiskScorer.inputs)
    make_target = functools.partial(McpdZmq, "mcpd", daemon.endpoint, "risk", inputs)
    pick = lambda rng: rng.randrange(16)   # noqa: E731
    expected = arrivals(200.0, 0.5, pick, seed=3, high_frac=0.5)
    with ClientProcesses(make_target, 2, prepare=16) as processes:
        outcomes = asyncio.run(processes.open_loop(200.0, 0.5, pick, seed=3, high_frac=0.5))
    assert [(o.scheduled_s, o.priority) for o in outcomes] == [(at, priority) for at, _, priority in expected]
    assert all(o.outcome == "ok" for o in outcomes)
