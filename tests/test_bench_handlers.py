"""What bench/handlers.py's comparison rests on, in-process and in seconds (the benchmark itself
needs LitServe's and MLServer's venvs): the Open Inference Protocol JSON every HTTP server gets
carries each datatype's values unchanged, a peer's HandlerRunner answers each request as the
handler alone does, the inputs are the same for every server, and the figures point the right way."""
from __future__ import annotations

import asyncio
import gc
import json
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import handlers  # noqa: E402
from peerkit import burst_stages, load, v2_json  # noqa: E402
from peerkit.batching_ceiling import batching_ceiling  # noqa: E402
from peerkit.handler_runner import HandlerRunner  # noqa: E402
from peerkit.handler_targets import TensorInputs  # noqa: E402
from peerkit.load import Outcome  # noqa: E402
from mcpd.config.loader import from_dict  # noqa: E402
from mcpd.handlers.tensors import TensorSpec  # noqa: E402

RISK = handlers.MODELS["risk"]
TEXT = handlers.MODELS["text"]


@pytest.mark.parametrize("datatype", [d for d in v2_json.DATATYPES if d != "BYTES"])
def test_json_bodies_carry_every_numeric_datatype_unchanged(datatype):
    array = TensorInputs({"x": TensorSpec(datatype, (-1, 3, -1))}).arrays(5)["x"]
    body = json.loads(v2_json.request_body({"x": array}))
    back = v2_json.inputs_of(body)["x"]
    assert body["inputs"][0]["datatype"] == datatype and back.dtype == array.dtype
    assert np.array_equal(back, array)


def test_json_bodies_carry_text_as_bytes():
    texts = np.empty(2, dtype=object)
    texts[:] = ["naïve café".encode(), b"plain"]
    back = v2_json.inputs_of(json.loads(v2_json.request_body({"text": texts})))["text"]
    assert back.dtype == object and list(back) == list(texts)


def test_input_i_is_the_same_for_every_server_and_differs_from_input_j():
    specs = {"features": TensorSpec("FP32", (-1, 256))}
    first, again, other = TensorInputs(specs).arrays(3), TensorInputs(specs).arrays(3), TensorInputs(specs).arrays(4)
    assert np.array_equal(first["features"], again["features"])
    assert not np.array_equal(first["features"], other["features"])


def test_a_peers_batch_answers_each_request_as_the_handler_alone_does():
    runner = HandlerRunner(RISK.handler, RISK.settings)
    inputs = TensorInputs(runner.handler.inputs)
    requests = [inputs.arrays(i) for i in range(5)]
    together = runner.run(requests)
    for request, answer in zip(requests, together):
        alone = runner.handler.predict(request)
        assert answer.keys() == alone.keys()
        assert np.allclose(answer["score"], alone["score"], rtol=1e-5, atol=1e-6)


def test_ratios_point_to_mcpd_leading_and_are_null_for_what_did_not_run():
    measured = {"models": {"risk": {"mcpd": {"rps": 300.0}, "mcpd-unbatched": {"rps": 60.0},
                                    "litserve": {"rps": 100.0}, "mlserver": {"rps": 150.0},
                                    "model-alone": {"ceiling": 7.5}},
                           "text": {"mcpd": {"rps": 90.0}, "mcpd-unbatched": {"rps": 50.0},
                                    "model-alone": {"ceiling": 2.0}}},
                "burst": {"burst_high_p99_ms": 30.0, "idle_high_p99_ms": 10.0, "high_p99_ratio": 3.0, "unanswered": 0}}
    figures = handlers.figures_of(measured)
    assert figures["handler_risk_rps_ratio_vs_best_peer"] == 2.0
    assert figures["batching_speedup_risk"] == 5.0
    assert figures["batching_ceiling_risk"] == 7.5
    assert figures["batching_speedup"] == 1.8 and figures["batching_ceiling_frac"] == 0.9
    assert figures["handler_high_p99_ratio"] == 3.0
    assert figures["handler_text_rps_ratio_vs_best_peer"] is None
    assert figures["cache_hit_rate"] is None and figures["context_bytes_ratio"] is None


def test_the_bursts_figures_are_its_median_rounds_whole():
    rounds = [({"high_p99_ratio": r, "idle_high_p99_ms": r}, {"idle": r}) for r in (5.0, 1.5, 2.5, 9.0)]
    assert handlers.median_round(rounds[:3]) == ({"high_p99_ratio": 2.5, "idle_high_p99_ms": 2.5}, {"idle": 2.5})
    assert handlers.median_round(rounds)[0]["high_p99_ratio"] == 5.0   # even: the higher middle one
    assert handlers.median_round(rounds[1:2])[1] == {"idle": 1.5}


class PreparedTarget:
    """Answers every request ok at once; its prepared inputs are objects the generator holds."""

    def prepare(self, count: int) -> None:
        self.prepared = [{"index": i} for i in range(count)]

    async def infer(self, index: int, priority: str) -> tuple[str, bool]:
        return "ok", False


def test_the_search_puts_what_the_generator_holds_out_of_the_collectors_reach(monkeypatch):
    """A full collection over the client's torch, model and inputs stalls the probes' loop."""
    monkeypatch.setattr(handlers, "WARM_UP_S", 0.05)
    target = PreparedTarget()
    try:
        found = asyncio.run(handlers.search(target, handlers.Sizes(0.05, 1, 0.05, 0.05)))
        assert found["rps"] > 0
        assert gc.get_freeze_count() >= handlers.INPUT_POOL
        first = target.prepared[0]
        assert not any(o is first for o in gc.get_objects())   # frozen: in no generation a collection walks
    finally:
        gc.unfreeze()


class BurstTarget(PreparedTarget):
    """Answers ok, except every request while `bursting` (a neighbour's burst took the machine)."""
    bursting = False

    async def infer(self, index: int, priority: str) -> tuple[str, bool]:
        return ("HTTP 503", False) if self.bursting else ("ok", False)


def test_a_search_round_that_a_burst_spoiled_does_not_cap_the_held_rate(monkeypatch):
    """Every system gets the same rounds and keeps its best: a burst over a whole round (both
    tries of every rate fail) leaves the other round's held rate as the figure."""
    monkeypatch.setattr(handlers, "WARM_UP_S", 0.05)
    target, real_max_rate, rounds_run = BurstTarget(), handlers.max_rate, []

    async def burst_in_the_first_round(*args, **kwargs):
        target.bursting = not rounds_run
        rounds_run.append(kwargs.get("seed"))
        return await real_max_rate(*args, **kwargs)

    monkeypatch.setattr(handlers, "max_rate", burst_in_the_first_round)
    try:
        found = asyncio.run(handlers.search(target, handlers.Sizes(0.05, 2, 0.05, 0.05, rounds=2)))
    finally:
        gc.unfreeze()
    assert len(set(rounds_run)) == 2   # each round its own arrivals
    assert found["rounds_rps"][0] == 0 and found["rps"] == found["rounds_rps"][1] > 0


def test_a_system_that_holds_every_rate_tried_is_read_past_its_closed_loop_capacity(monkeypatch):
    """The search's top (SEARCH_HIGH times the capacity read closed-loop) is not a bound until a
    rate fails there: a server that holds an open loop above its closed-loop reading is read so."""
    monkeypatch.setattr(handlers, "WARM_UP_S", 0.05)
    low_reading = 50.0

    async def closed_loop_read_low(*args, **kwargs):
        return low_reading

    monkeypatch.setattr(handlers, "closed_loop", closed_loop_read_low)
    try:
        found = asyncio.run(handlers.search(PreparedTarget(), handlers.Sizes(0.05, 6, 0.2, 0.05, rounds=1)))
    finally:
        gc.unfreeze()
    assert found["rps"] > load.SEARCH_HIGH * low_reading, found


class PredictSpy:
    """Records the batches the real handler's predict gets (their rows, and the padded length)."""

    def __init__(self, handler):
        self.predict, self.seen = handler.predict, []
        handler.predict = self

    def __call__(self, batch):
        first = next(iter(batch.values()))
        self.seen.append((len(first), first.shape[1] if first.ndim > 1 else 0))
        return self.predict(batch)


@pytest.mark.parametrize("model", [RISK, TEXT], ids=["risk", "text"])
def test_the_batching_ceiling_times_predict_on_the_same_rows_alone_and_in_full_batches(model):
    runner = HandlerRunner(model.handler, model.settings)
    spy = PredictSpy(runner.handler)
    inputs = TensorInputs(runner.handler.inputs)
    found = batching_ceiling(runner, [inputs.arrays(i) for i in range(12)], max_batch=4, threads=1)
    rounds = [spy.seen[at:at + 15] for at in range(0, len(spy.seen), 15)]
    assert len(rounds) == 5 and all(rows == [1] * 12 + [4, 4, 4] for rows in ([r for r, _ in turn] for turn in rounds))
    full_lengths = [length for _, length in rounds[0][12:]]
    assert full_lengths == sorted(full_lengths)   # full batches of similar length, as length bins make them
    assert found["batch_1_us_per_row"] > 0 and found["batch_4_us_per_row"] > 0
    assert found["ceiling"] == pytest.approx(found["batch_1_us_per_row"] / found["batch_4_us_per_row"], rel=0.02)


def _span(trace: str, name: str, start_ms: float, end_ms: float, **attributes) -> dict:
    """A span as the daemon's file exporter writes it (mcpd/tracing/file_exporter.py's line_of)."""
    return {"name": name, "trace_id": trace, "start_ns": int(start_ms * 1e6), "end_ns": int(end_ms * 1e6),
            "attributes": attributes}


def test_high_spans_split_only_the_high_requests_traced_from_the_bursts_start(tmp_path):
    spans = [
        _span("idle", "mcpd.request", 1, 5), _span("idle", "scheduler.admit", 2, 3, **{"mcpd.class": "high"}),
        _span("low", "mcpd.request", 10, 90), _span("low", "scheduler.admit", 11, 12, **{"mcpd.class": "low"}),
        _span("high-a", "mcpd.request", 10, 14), _span("high-a", "scheduler.admit", 11, 11.5, **{"mcpd.class": "high"}),
        _span("high-a", "hop.to_frontend", 12, 13),
        _span("high-b", "mcpd.request", 20, 40), _span("high-b", "scheduler.admit", 21, 21.5, **{"mcpd.class": "high"}),
        _span("high-b", "hop.to_frontend", 22, 38),
    ]
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps(span) + "\n" for span in spans))
    split = burst_stages.high_spans_ms(path, since_ns=int(10 * 1e6))
    assert split == {"mcpd.request": {"n": 2, "p50": 4.0, "p99": 20.0},
                     "scheduler.admit": {"n": 2, "p50": 0.5, "p99": 0.5},
                     "hop.to_frontend": {"n": 2, "p50": 1.0, "p99": 16.0}}


def test_a_traced_requests_parts_join_the_clients_times_to_the_daemons_spans_by_request_id(tmp_path):
    # The client's clock: due at 1.000 s, sent at 1.002 s, its reply stamped at 1.030 s, after a
    # start of 100 s; the daemon stamps spans offset by 5 s: its mcpd.request runs 106.005-106.025 s.
    def ms(seconds: float) -> float:
        return (100 + 5 + seconds) * 1e3
    spans = [_span("t1", "mcpd.request", ms(1.005), ms(1.025), **{"mcpd.request_id": 7}),
             _span("t1", "worker.predict", ms(1.010), ms(1.020)),
             _span("t2", "mcpd.request", ms(2.0), ms(2.001), **{"mcpd.request_id": 8}),   # another run's id 8
             _span("t3", "mcpd.request", ms(1.0), ms(1.01), **{"mcpd.request_id": 9})]    # a low one
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps(span) + "\n" for span in spans))
    outcomes = [Outcome("high", "ok", 0.030, False, 1.0, 1.002, request_id=7),
                Outcome("high", "ok", 0.030, False, 1.0, 1.002, request_id=8),
                Outcome("low", "ok", 0.030, False, 1.0, 1.002, request_id=9)]
    found = burst_stages.request_parts_ms(path, outcomes, started=100.0, offset_ns=int(5e9), priority="high")
    assert found["n"] == 1
    parts = {name: part["p50"] for name, part in found["parts"].items()}
    assert parts == pytest.approx({"total": 30, "generator_lag": 2, "to_frontend_read": 3, "mcpd.request": 20,
                                   "worker.predict": 10, "reply_to_client": 5, **{name: 0 for name in parts if name
                                   not in ("total", "generator_lag", "to_frontend_read", "mcpd.request",
                                           "worker.predict", "reply_to_client")}}, abs=1e-3)


def test_highs_are_split_by_when_in_the_burst_they_were_sent_beside_the_first_low_refused():
    # (priority, outcome, seconds from due, sent after the start, sent late by): p99s from the send
    sent = [("high", "ok", 0.102, 0.1, 0.002), ("high", "ok", 0.300, 0.3, 0.0), ("high", "ok", 0.010, 0.3, 0.0),
            ("high", "OVERLOADED", 0.001, 0.4, 0.0), ("low", "ok", 0.05, 0.2, 0.0),
            ("low", "OVERLOADED", 0.001, 0.45, 0.0), ("low", "OVERLOADED", 0.001, 1.5, 0.0),
            ("high", "ok", 0.004, 3.0, 0.0)]
    outcomes = [Outcome(priority, code, seconds, False, at - lag, at) for priority, code, seconds, at, lag in sent]
    found = burst_stages.high_p99_by_send_time(outcomes, burst_s=4.0)
    assert found["first_low_refused_s"] == 0.45
    windows = found["windows"]
    assert list(windows) == ["0-0.25s", "0.25-0.5s", "0.5-1s", "1-2s", "2s-end"]
    assert windows["0-0.25s"] == {"n": 1, "p99": 100.0}
    assert windows["0.25-0.5s"] == {"n": 2, "p99": 300.0}   # nearest rank: the slower one
    assert windows["0.5-1s"] == {"n": 0, "p99": None} and windows["2s-end"] == {"n": 1, "p99": 4.0}
    assert list(burst_stages.high_p99_by_send_time(outcomes, burst_s=0.4)["windows"]) == ["0-0.25s", "0.25s-end"]


def test_the_bursts_control_is_a_fifo_scheduler_without_edge_shedding():
    config = from_dict({"scheduler": handlers.CONTROL_SCHEDULER})
    assert config.scheduler.policy == "fifo" and not config.scheduler.shed_wait_ms


def test_run_queue_counts_the_slices_of_every_thread_of_a_process():
    """Each time a thread wakes from a sleep it gets a core once more: a second thread's wake-ups
    count in its process's slices while it lives, and a process that is gone reads as zeros."""
    import os
    import threading
    import time

    napped, done = threading.Event(), threading.Event()

    def naps():
        for _ in range(20):
            time.sleep(0.001)
        napped.set()
        done.wait()

    before = burst_stages._run_queue(os.getpid())
    napper = threading.Thread(target=naps)
    napper.start()
    napped.wait()
    waited, slices = (now - then for now, then in zip(burst_stages._run_queue(os.getpid()), before))
    done.set()
    napper.join()
    assert slices >= 20 and waited >= 0
    assert burst_stages._run_queue(2 ** 22 + 1) == (0, 0)


def test_on_a_gpu_each_model_batches_up_to_its_gpu_size_and_keeps_the_rest():
    for model in (RISK, TEXT):
        on_cpu, on_gpu = handlers.mcpd_batching(model), handlers.mcpd_batching(model, "cuda")
        assert on_cpu == {**model.batching, **({"length_bins": list(model.length_bins)} if model.length_bins else {})}
        assert on_gpu == {**on_cpu, "max_batch_size": model.gpu_max_batch_size}
    assert TEXT.gpu_max_batch_size > TEXT.batching["max_batch_size"]


def test_the_gpu_run_leaves_the_peers_out_and_needs_a_gpu(capsys):
    import argparse
    import subprocess

    import torch

    parser = argparse.ArgumentParser()
    with pytest.raises(SystemExit):
        handlers.check_device(parser, "cuda", ["litserve"])
    assert "the peers (litserve) run on the CPU" in capsys.readouterr().err
    handlers.check_device(parser, "cpu", ["litserve", "mlserver"])
    if torch.cuda.is_available():
        return
    bench = Path(__file__).resolve().parents[1] / "bench" / "handlers.py"
    done = subprocess.run([sys.executable, str(bench), "--device", "cuda", "--peers", "", "--quick"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "torch sees no CUDA device" in done.stderr and not done.stdout


def test_core_stalls_finds_the_time_its_spinners_were_stopped():
    """Each core's spinner, stopped for STOP_S once it is spinning, reads a gap at least that long."""
    import os
    import signal
    import threading
    import time

    from peerkit.core_stalls import core_stalls

    stop_s, found = 0.05, {}
    measuring = threading.Thread(target=lambda: found.update(core_stalls(4.0)))
    measuring.start()
    me, stopped = psutil.Process(), set()
    while measuring.is_alive() and len(stopped) < len(os.sched_getaffinity(0)):
        for child in me.children():
            if child.pid not in stopped and child.cpu_times().user > 0.2:   # in its loop, spinning
                os.kill(child.pid, signal.SIGSTOP)
                time.sleep(stop_s)
                os.kill(child.pid, signal.SIGCONT)
                stopped.add(child.pid)
        time.sleep(0.01)
    measuring.join()
    assert set(found) == {f"cpu{cpu}" for cpu in os.sched_getaffinity(0)}
    for figures in found.values():
        assert figures["longest_ms"] >= stop_s * 1e3 and figures["long_gaps_per_s"] >= 1 / 4.0
        assert 0 < figures["lost_share"] < 1
