"""bench/overhead.py --only noop: the ping against the raw echo and the bare relay chain alone, run
for real (a daemon, the echo and the chain's three processes) with a handful of requests."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import overhead  # noqa: E402


def test_only_noop_prints_the_ping_against_the_relay_chain_as_one_json_line(capsys):
    overhead.noop_only(count=50, total=200, window=16, quick=True)
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["only"] == "noop" and figures["rounds"] == overhead.ROUNDS
    assert min(figures["raw_p50_us"], figures["relay_p50_us"], figures["mcpd_p50_us"], figures["mcpd_rps"]) > 0
    # The ratio is of the unrounded p50s, the p50s are printed to 0.1 µs.
    assert abs(figures["noop_p50_ratio_vs_relay"] - figures["mcpd_p50_us"] / figures["relay_p50_us"]) < 0.01
