"""The context delta codec in one process: diff -> wire -> apply of a 64 MB float32 field.

    python bench/delta_codec.py [--quick] [--elements N]

For 0.1%, 1% and 10% of the elements replaced at random positions, and for a wholly fresh array,
times `diff` (old against new, on the sender) and `from_wire` + `apply` (on the receiver; the
entries go through msgpack as on the wire), and reports the payload against the field's size.
Medians of several runs. This is the codec alone; the sync through the daemon is measured
end to end elsewhere. Last line JSON: delta_payload_frac at 1% (target <= 0.03), diff_ms,
apply_ms, full_resend_bytes, and the same figures for every case under "cases".
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import msgpack
import numpy as np

from mcpd.protocol.delta import DeltaLimits, apply, diff, from_wire, to_wire

CHANGED_FRACTIONS = {"0.1%": 0.001, "1%": 0.01, "10%": 0.1}


def changed_copy(rng: np.random.Generator, old: np.ndarray, fraction: float) -> np.ndarray:
    new = old.copy()
    where = rng.choice(old.size, int(old.size * fraction), replace=False)
    new[where] = rng.standard_normal(where.size, dtype=old.dtype)
    return new


def measure(old: np.ndarray, new: np.ndarray, runs: int) -> dict:
    """Median timings of one sync of `new` onto `old`, checked bit-exact."""
    limits = DeltaLimits()
    diff_ms, apply_ms = [], []
    for _ in range(runs):
        started = time.perf_counter()
        delta = diff("weights", old, new)
        diffed = time.perf_counter()
        entries, frames = to_wire([delta])
        entries = msgpack.packb(entries)
        received = time.perf_counter()
        (incoming,) = from_wire(msgpack.unpackb(entries), frames, limits)
        result = apply(old, incoming, limits)
        applied = time.perf_counter()
        diff_ms.append((diffed - started) * 1e3)
        apply_ms.append((applied - received) * 1e3)
    if result.tobytes() != new.tobytes():
        raise AssertionError("the synced array differs from the new one")
    payload = len(delta.data)
    return {"kind": delta.kind, "codec": delta.meta.codec, "payload_bytes": payload,
            "delta_payload_frac": round(payload / new.nbytes, 5),
            "diff_ms": round(statistics.median(diff_ms), 1), "apply_ms": round(statistics.median(apply_ms), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 runs per case instead of 9")
    parser.add_argument("--elements", type=int, default=16 << 20, help="float32 elements (default 16 Mi: 64 MB)")
    args = parser.parse_args()
    runs = 3 if args.quick else 9
    rng = np.random.default_rng(0)
    old = rng.standard_normal(args.elements, dtype=np.float32)
    news = {label: changed_copy(rng, old, fraction) for label, fraction in CHANGED_FRACTIONS.items()}
    news["fresh"] = rng.standard_normal(args.elements, dtype=np.float32)

    print(f"field: {old.size} float32 = {old.nbytes} bytes, median of {runs} runs")
    print(f"{'changed':>8} {'kind':>6} {'codec':>5} {'payload':>11} {'frac':>8} {'diff ms':>8} {'apply ms':>9}")
    cases = {}
    for label, new in news.items():
        case = cases[label] = measure(old, new, runs)
        print(f"{label:>8} {case['kind']:>6} {case['codec']:>5} {case['payload_bytes']:>11} "
              f"{case['delta_payload_frac']:>8.4f} {case['diff_ms']:>8.1f} {case['apply_ms']:>9.1f}")
    one_percent = cases["1%"]
    print(json.dumps({"field_bytes": old.nbytes, "full_resend_bytes": old.nbytes,
                      "delta_payload_frac": one_percent["delta_payload_frac"],
                      "diff_ms": one_percent["diff_ms"], "apply_ms": one_percent["apply_ms"],
                      "cases": cases}))


if __name__ == "__main__":
    main()
