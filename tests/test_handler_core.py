"""The handler worker's core in-process: typed messages and a clock in, typed messages out, the
handler's predict on the core's own thread (a test waits for it, then steps). What crosses
processes (replies reaching clients, a hung worker's restart) is tests/test_handlers_daemon.py's."""
import logging
from concurrent.futures import wait

import msgpack
import numpy as np
import pytest

import faulty_handlers
from fakes import Clock, Ports, decoded
from mcpd.config import Config, VersionConfig
from mcpd.config.handlers import BatchingConfig
from mcpd.daemon import messages, model_stats
from mcpd.daemon.worker.done_notes import DONE_FLUSH_S
from mcpd.daemon.worker.handler_core import HandlerCore, HandlerHung
from mcpd.handlers import tensors
from mcpd.handlers.tensor_header import TensorHeader
from mcpd.protocol import codes
from mcpd.protocol.args import InferArgs, PingArgs

RULES = "mcpd.handlers.examples.risk_scorer:RiskRules"
DELAY_S = 0.010


def make_core(max_batch_size: int = 4, timeout_s: float = 30.0) -> HandlerCore:
    version = VersionConfig(handler=RULES, handler_timeout_s=timeout_s,
                            batching=BatchingConfig(max_batch_size=max_batch_size, max_queue_delay_ms=DELAY_S * 1000))
    handler = faulty_handlers.Faulty()
    handler.setup("cpu", {})
    return HandlerCore(Config(model=version), 0, handler, "cpu", logging.getLogger("test"), Ports(), Clock(),
                       serves=("risk", "v1"))


@pytest.fixture
def core():
    core = make_core()
    yield core
    faulty_handlers.release_hung()
    core.predictor.shutdown()


def features(rows: int, seed: int, trigger: float | None = None) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(rows, 256)).astype(np.float32)
    if trigger is not None:
        x[0, 0] = trigger
    return x


def send(core, rid: int, inputs: dict, rank: int = 0, **args) -> None:
    headers, frames = [], []
    for name, array in inputs.items():
        header, frame = tensors.encode(name, array)
        headers.append(header)
        frames.append(frame)
    dispatch = messages.Dispatch(rid, f"req-{rid}", "t", rank, False, InferArgs(inputs=tuple(headers), **args))
    core.on_message(*decoded(messages.encode(dispatch, *frames)))


def finish_running(core) -> None:
    """Wait for the predict in flight, then step: its replies go out, the next batch starts."""
    assert core.running is not None
    wait([core.running.future], timeout=30)
    core.step()


def run_until_idle(core) -> None:
    while core.has_work:
        if core.running is None:
            core.clock.now += DELAY_S
            core.step()
        else:
            finish_running(core)


def finals(core) -> dict[int, tuple[dict, list[bytes]]]:
    return {m.rid: (msgpack.unpackb(frames[0]), frames[1:]) for m, frames in core.ports.frontend
            if isinstance(m, messages.Final)}


def scores(reply: tuple[dict, list[bytes]]) -> np.ndarray:
    header, frames = reply
    assert header["kind"] == "ok", header
    (described,) = header["result"]["outputs"]
    return tensors.decode(TensorHeader(described["name"], described["datatype"], tuple(described["shape"])), frames[0])


def expected(x: np.ndarray) -> np.ndarray:
    rules = faulty_handlers.Faulty()
    rules.setup("cpu", {})
    return rules.predict({"features": x})["score"]


def test_requests_wait_for_the_delay_then_run_as_one_batch(core):
    xs = {rid: features(1, rid) for rid in range(3)}
    for rid, x in xs.items():
        send(core, rid, {"features": x})
    core.step()
    assert core.running is None and core.poll_timeout_ms(100) == pytest.approx(DELAY_S * 1000)
    core.clock.now += DELAY_S
    core.step()
    finish_running(core)
    replies = finals(core)
    for rid, x in xs.items():
        np.testing.assert_allclose(scores(replies[rid]), expected(x), rtol=1e-6)
        assert replies[rid][0]["result"]["model"] == "risk" and replies[rid][0]["result"]["version"] == "v1"
    stats = core.stats()
    assert (stats.batches, stats.rows, stats.mean_batch_rows) == (1, 3, 3.0)


def test_once_its_predicts_are_measured_a_lone_request_on_a_quiet_worker_goes_without_waiting_the_delay(core):
    send(core, 1, {"features": features(1, 1)})
    core.clock.now += DELAY_S
    core.step()
    finish_running(core)
    send(core, 2, {"features": features(1, 2)})
    send(core, 3, {"features": features(1, 3)})
    core.clock.now += DELAY_S
    core.step()
    finish_running(core)   # predicts of two sizes: the worker knows what one costs
    assert core.batcher.cost.known
    core.clock.now += 1.0   # a request a second: none would join it in a predict's time
    send(core, 4, {"features": features(1, 4)})
    core.step()
    assert core.running is not None and [r.rid for r in core.running.requests] == [4]


def test_a_full_batch_goes_at_once(core):
    for rid in range(2):
        send(core, rid, {"features": features(2, rid)})
    core.step()   # 4 rows: max_batch_size, no wait for the delay
    assert core.running is not None and len(core.running.requests) == 2


def test_a_request_of_a_class_above_the_default_runs_at_once_and_takes_the_waiting_with_it(core):
    classes = core.config.scheduler.classes
    default, high = classes[core.config.scheduler.default_class].rank, classes["high"].rank
    send(core, 1, {"features": features(1, 1)}, rank=default)
    core.step()
    assert core.running is None   # the default class waits for others to join it
    send(core, 2, {"features": features(1, 2)}, rank=high)
    core.step()
    assert core.running is not None and [r.rid for r in core.running.requests] == [2, 1]
    finish_running(core)
    assert set(finals(core)) == {1, 2}


def test_the_urgent_replies_of_a_batch_are_sent_before_the_others_are_built(core):
    """A high request's reply leaves the worker ahead of the rest of its batch's, not when the
    whole batch has been answered; a batch without one is sent as one."""
    classes = core.config.scheduler.classes
    default, high = classes[core.config.scheduler.default_class].rank, classes["high"].rank
    for rid in (1, 2):
        send(core, rid, {"features": features(1, rid)}, rank=default)
    send(core, 3, {"features": features(1, 3)}, rank=high)
    core.step()
    assert [r.rid for r in core.running.requests] == [3, 1, 2]
    finish_running(core)
    assert [m.rid for m, _ in core.ports.frontend] == [3, 1, 2] and core.ports.flushed_at == [1]
    for rid in (4, 5, 6, 7):
        send(core, rid, {"features": features(1, rid)}, rank=default)
    core.step()   # 4 rows: a full batch
    finish_running(core)
    assert set(finals(core)) == set(range(1, 8)) and core.ports.flushed_at == [1]


def test_the_next_batch_forms_while_a_predict_runs(core):
    faulty_handlers.hang_again()   # the predict runs until released
    send(core, 0, {"features": features(4, 0, faulty_handlers.HANG)})
    core.step()
    running = core.running
    send(core, 1, {"features": features(4, 1)})   # arrives, is decoded and waits meanwhile
    assert core.running is running and len(core.batcher) == 1
    faulty_handlers.release_hung()
    finish_running(core)
    assert 0 in finals(core) and core.running is not None and core.running.requests[0].rid == 1


def test_a_full_batch_queues_behind_the_running_predict_and_runs_without_the_loop(core):
    """A partial batch waits for the predict thread (more rows may join it); a full one is
    queued on the thread and runs when the predict ahead of it ends, before the loop steps."""
    faulty_handlers.hang_again()
    send(core, 0, {"features": features(1, 0, faulty_handlers.HANG)})
    core.clock.now += DELAY_S
    core.step()
    send(core, 1, {"features": features(2, 1)})
    core.clock.now += DELAY_S
    core.step()
    assert len(core.batcher) == 1   # 2 rows of 4: it waits for the thread
    send(core, 2, {"features": features(2, 2)})
    core.step()
    assert len(core.batcher) == 0 and len(core.predictor.in_flight) == 2
    faulty_handlers.release_hung()
    wait([running.future for running in core.predictor.in_flight], timeout=30)   # no step between
    core.step()
    replies = finals(core)
    assert set(replies) == {0, 1, 2} and not core.has_work
    np.testing.assert_allclose(scores(replies[2]), expected(features(2, 2)), rtol=1e-6)


def test_the_next_batch_starts_before_the_ended_batchs_replies_are_sent(core):
    """The predict thread is not left idle while the ended batch's replies are built and sent."""
    send(core, 0, {"features": features(4, 0)})
    send(core, 1, {"features": features(4, 1)})
    core.step()
    predicting_at_reply = []
    sent = core.ports.to_frontend
    core.ports.to_frontend = lambda *message: (predicting_at_reply.append(core.running is not None), sent(*message))
    finish_running(core)
    assert 0 in finals(core) and predicting_at_reply == [True]
    assert core.running.requests[0].rid == 1


def test_a_message_that_comes_after_a_predict_ends_waits_for_the_next_batch_to_start(core):
    send(core, 0, {"features": features(4, 0)})
    send(core, 1, {"features": features(4, 1)})
    core.step()
    wait([core.running.future], timeout=30)
    send(core, 2, {"features": features(1, 2)})   # taken before the loop steps
    assert 0 in finals(core) and [r.rid for r in core.running.requests] == [1]
    assert len(core.batcher) == 1


@pytest.mark.parametrize("inputs, message", [
    ({"salary": features(1, 0)}, "has no input 'salary'"),
    ({"features": features(1, 0).astype(np.float64)}, "input 'features' is FP64"),
    ({"features": features(1, 0)[:, :100]}, "input 'features' has shape [1, 100]"),
])
def test_bad_inputs_are_refused_naming_the_input(core, inputs, message):
    send(core, 7, inputs)
    header, _ = finals(core)[7]
    assert header["code"] == codes.BAD_INPUT and message in header["message"], header
    assert not core.has_work


def test_a_frame_of_the_wrong_size_is_bad_input(core):
    header = TensorHeader("features", "FP32", (2, 256))
    dispatch = messages.Dispatch(1, "r", "t", 0, False, InferArgs(inputs=(header,)))
    core.on_message(*decoded(messages.encode(dispatch, features(1, 0).tobytes())))
    reply, _ = finals(core)[1]
    assert reply["code"] == codes.BAD_INPUT and "2048 bytes; its frame has 1024" in reply["message"]


def test_an_output_the_model_lacks_is_bad_input(core):
    send(core, 1, {"features": features(1, 0)}, outputs=("score", "reason"))
    reply, _ = finals(core)[1]
    assert reply["code"] == codes.BAD_INPUT and "no output 'reason'" in reply["message"]


@pytest.mark.parametrize("trigger, message", [
    (faulty_handlers.RAISE, "predict raised RuntimeError: this handler raises on purpose"),
    (faulty_handlers.WRONG_ROWS, "handler returned 1 rows for 2"),   # its own run, alone
])
def test_a_failing_batch_costs_only_the_request_that_fails(core, trigger, message):
    good = {0: features(2, 0), 2: features(1, 2)}
    send(core, 0, {"features": good[0]})
    send(core, 1, {"features": features(2, 1, trigger)})
    send(core, 2, {"features": good[2]})
    run_until_idle(core)
    replies = finals(core)
    assert replies[1][0]["code"] == codes.INTERNAL and message in replies[1][0]["message"], replies[1][0]
    for rid, x in good.items():
        np.testing.assert_allclose(scores(replies[rid]), expected(x), rtol=1e-6)


def test_a_cancel_answers_a_waiting_request_and_one_in_the_running_batch(core):
    faulty_handlers.hang_again()   # the batch runs until released
    send(core, 0, {"features": features(2, 0, faulty_handlers.HANG)})
    send(core, 1, {"features": features(2, 1)})
    core.step()                                        # 0 and 1 run
    send(core, 2, {"features": features(1, 2)})        # 2 waits
    core.on_message(*decoded(messages.encode(messages.Cancel(2, codes.CANCELLED))))
    core.on_message(*decoded(messages.encode(messages.Cancel(1, codes.DEADLINE_EXCEEDED))))
    replies = finals(core)
    assert replies[2][0]["code"] == codes.CANCELLED and replies[1][0]["code"] == codes.DEADLINE_EXCEEDED
    faulty_handlers.release_hung()
    run_until_idle(core)
    replies = finals(core)
    assert scores(replies[0]).shape == (2,)
    assert [m.rid for m, _ in core.ports.frontend].count(1) == 1   # its result, when it came, went nowhere


def test_a_hung_predict_is_answered_by_its_deadline_then_stops_the_worker():
    core = make_core(timeout_s=5.0)
    faulty_handlers.hang_again()
    try:
        send(core, 0, {"features": features(1, 0, faulty_handlers.HANG)})
        core.clock.now += DELAY_S
        core.step()
        core.on_message(*decoded(messages.encode(messages.Cancel(0, codes.DEADLINE_EXCEEDED))))
        assert finals(core)[0][0]["code"] == codes.DEADLINE_EXCEEDED
        core.clock.now += 4.0
        core.step()   # still within handler_timeout_s
        core.flush_done()
        assert core.poll_timeout_ms(10_000) == pytest.approx(1000)   # the loop wakes when it runs out
        core.clock.now += 1.1
        with pytest.raises(HandlerHung):
            core.step()
    finally:
        faulty_handlers.release_hung()
        core.predictor.shutdown()


def test_a_pings_done_note_waits_for_company_then_goes(core):
    core.on_message(*decoded(messages.encode(messages.Dispatch(5, "p", "t", 0, False, PingArgs()))))
    assert finals(core)[5][0]["result"]["pong"] is True
    core.flush_done()   # a ping is no work: its note waits for others (done_notes.py)
    assert [m.rids for m, _ in core.ports.scheduler if isinstance(m, messages.Done)] == []
    core.clock.now += DONE_FLUSH_S
    core.flush_done()
    assert [m.rids for m, _ in core.ports.scheduler if isinstance(m, messages.Done)] == [[5]]


def test_hello_carries_the_handlers_signature(core):
    hello = core.hello()
    assert (hello.served_model, hello.version, hello.model) == ("risk", "v1", RULES)
    assert hello.signature == model_stats.Signature({"features": model_stats.TensorMetadata("FP32", [-1, 256])},
                                                 {"score": model_stats.TensorMetadata("FP32", [-1])})
