"""bench/overhead.py --only noop: the ping against the raw echo and the bare relay chain alone, run
for real (a daemon, the echo and the chain's three processes) with a handful of requests."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import overhead  # noqa: E402


def test_only_noop_prints_the_ping_against_the_relay_chain_as_one_json_line(capsys):
    overhead.noop_only(count=50, total=200, window=16, quick=True)
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["only"] == "noop" and figures["rounds"] == overhead.LATENCY_ROUNDS
    assert min(figures["raw_p50_us"], figures["relay_p50_us"], figures["mcpd_p50_us"], figures["mcpd_rps"]) > 0
    # The ratio is the median of the rounds' ratios, printed with the middle half of them.
    ratio, q1, q3 = (figures[f"noop_p50_ratio_vs_relay{end}"] for end in ("", "_q1", "_q3"))
    assert 0 < q1 <= ratio <= q3
    # Each process's CPU per sequential ping, the daemon's beside the chain's process in its place.
    assert set(figures["cpu_us_per_ping"]) == {"mcpd", "relay"}
    for processes in figures["cpu_us_per_ping"].values():
        assert set(processes) == set(overhead.ROLES) and min(processes.values()) > 0


def test_a_ratio_is_the_median_of_the_rounds_own_ratios():
    """A busy round slows every target in it: its ratio counts once, and its p50s not at all."""
    rounds = [[[1.0, 2.0, 3.0], [2.0, 2.0, 2.0]],       # target 0 at 2.0 over target 1 at 2.0: ratio 1.0
              [[30.0, 30.0, 30.0], [20.0, 20.0, 20.0]],  # a busy round: 1.5
              [[1.2, 1.2, 1.2], [1.0, 1.0, 1.0]],       # 1.2
              [[1.1, 1.1, 1.1], [1.0, 1.0, 1.0]]]       # 1.1
    assert overhead.round_ratios(rounds, 0, 1) == pytest.approx({"median": 1.15, "q1": 1.0, "q3": 1.2})
