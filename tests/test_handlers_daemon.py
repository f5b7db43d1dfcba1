"""Handler models through the real daemon: the `infer` op from a client's socket to a handler's
worker and back, batched; every hostile input answered with its code while good requests go on
and the worker survives; a hanging handler's worker restarted; the other kind's op refused."""
import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from mcpd.client import AsyncClient
from mcpd.handlers.examples.risk_scorer import RiskScorer
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.testing import Daemon
import faulty_handlers
from conftest import DAEMON_ENVIRONMENT
from test_metrics import scrape, total

REPO = Path(__file__).resolve().parent.parent
SCORER = "mcpd.handlers.examples.risk_scorer:RiskScorer"
FAULTY = "faulty_handlers:Faulty"
HANG_TIMEOUT_S = 3.0
BULK_BATCH = 8


@pytest.fixture(scope="module")
def daemon():
    d = Daemon(environment={**DAEMON_ENVIRONMENT, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}, **{
        "pool": {"shared": False}, "metrics": {"listen": "127.0.0.1:0"},
        "models.chat": {}, "models.chat.versions.v1": {},   # the embedded language model
        "models.risk": {"default": "v1"},
        "models.risk.versions.v1": {"handler": SCORER},
        "models.risk.versions.v1.settings": {"seed": 3},
        # Batches of exactly 8 rows: a batch never goes out for its delay, whatever the machine's pace.
        "models.bulk": {}, "models.bulk.versions.v1": {"handler": SCORER},
        "models.bulk.versions.v1.settings": {"seed": 3},
        "models.bulk.versions.v1.batching": {"max_batch_size": BULK_BATCH, "max_queue_delay_ms": 10_000.0},
        "models.risk.versions.v2": {"handler": SCORER},
        "models.risk.versions.v2.settings": {"seed": 7},
        "models.faulty": {}, "models.faulty.versions.v1": {"handler": FAULTY},
        "models.stuck": {}, "models.stuck.versions.v1": {"handler": FAULTY, "handler_timeout_s": HANG_TIMEOUT_S},
    })
    d.start()
    yield d
    d.stop()
    d.cleanup()


def scorer(seed: int) -> RiskScorer:
    handler = RiskScorer()
    handler.setup("cpu", {"seed": seed})
    return handler


def features(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, 256)).astype(np.float32)


def worker_pid(daemon, model: str) -> int:
    index = daemon.client().status()["models"]["models"][model]["versions"]["v1"]["workers"][0]
    return daemon.pid_of("worker", index)


def test_infer_round_trip_scores_as_the_handler_in_process(daemon):
    x = features(5)
    result = daemon.client().infer("risk", {"features": x}, version="v1")
    assert (result.model, result.version, result.cached) == ("risk", "v1", False)
    assert result.outputs["score"].dtype == np.float32 and result.outputs["score"].shape == (5,)
    np.testing.assert_allclose(result.outputs["score"], scorer(3).predict({"features": x})["score"], rtol=1e-5)


def test_the_async_client_infers_too(daemon):
    async def run():
        async with AsyncClient(daemon.endpoint) as client:
            return await asyncio.gather(*(client.infer("risk", {"features": features(2, i)}, version="v1")
                                          for i in range(4)))
    for i, result in enumerate(asyncio.run(run())):
        np.testing.assert_allclose(result.outputs["score"], scorer(3).predict({"features": features(2, i)})["score"],
                                   rtol=1e-5)


def test_status_shows_each_versions_kind_and_signature(daemon):
    versions = daemon.client().status()["models"]["models"]   # the scheduler's own, not a report of it
    assert versions["chat"]["versions"]["v1"]["kind"] == "language"
    risk = versions["risk"]["versions"]["v1"]
    assert risk["kind"] == "handler"
    assert risk["signature"] == {"inputs": {"features": {"datatype": "FP32", "shape": [-1, 256]}},
                                 "outputs": {"score": {"datatype": "FP32", "shape": [-1]}}}


def test_concurrent_requests_run_in_batches(daemon):
    requests = 6 * BULK_BATCH
    with ThreadPoolExecutor(2 * BULK_BATCH) as pool:
        results = list(pool.map(lambda i: daemon.client().infer("bulk", {"features": features(1, i)}),
                                range(requests)))
    expected = scorer(3)
    for i, result in enumerate(results):
        np.testing.assert_allclose(result.outputs["score"], expected.predict({"features": features(1, i)})["score"],
                                   rtol=1e-5)
    daemon.wait_until(lambda: _bulk_worker_stats(daemon).get("rows") == requests, timeout=30,
                      what="the worker's report of the rows it ran")
    stats = _bulk_worker_stats(daemon)
    assert (stats["batches"], stats["mean_batch_rows"]) == (6, BULK_BATCH)
    worker = str(stats["index"])
    daemon.wait_until(lambda: total(scrape(daemon), "mcpd_handler_rows_total", worker=worker) == requests, timeout=30,
                      what="the rows in the Prometheus figures")
    assert total(scrape(daemon), "mcpd_handler_batches_total", worker=worker) == 6


def _bulk_worker_stats(daemon) -> dict:
    """The scheduler's latest figures of the bulk model's worker (its Stats, every stats_interval_s)."""
    return next(w for w in daemon.client().status()["workers"] if w.get("served_model") == "bulk")


def test_a_split_between_two_handler_versions_answers_from_each(daemon):
    daemon.control("models.split", {"model": "risk", "weights": {"v1": 1.0, "v2": 1.0}})
    try:
        client, x = daemon.client(), features(2)
        answered = {}
        for key in range(40):
            result = client.infer("risk", {"features": x}, routing_key=f"user-{key}")
            answered[result.version] = result.outputs["score"]
    finally:
        daemon.control("models.promote", {"model": "risk", "version": "v1"})
    assert set(answered) == {"v1", "v2"}
    for version, seed in (("v1", 3), ("v2", 7)):
        np.testing.assert_allclose(answered[version], scorer(seed).predict({"features": x})["score"], rtol=1e-5)


def test_mcpctl_lists_each_versions_kind(daemon):
    listed = daemon.mcpctl("models")
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()[1:]]
    kinds = {(row[0], row[2] if row[1] == "(default)" else row[1]): row[-1] for row in rows}
    assert kinds[("chat", "v1")] == "language" and kinds[("risk", "v1")] == "handler"


def test_the_other_kinds_op_is_refused(daemon):
    client = daemon.client()
    with pytest.raises(MCPDError) as refused:
        client.infer("chat", {"features": features(1)})
    assert refused.value.code == codes.BAD_REQUEST and "language model" in refused.value.message
    with pytest.raises(MCPDError) as refused:
        client.generate("hello", model="risk", max_tokens=2)
    assert refused.value.code == codes.BAD_REQUEST and "handler model" in refused.value.message


def raw_infer(endpoint: str, inputs: list[dict], frames: list[bytes], model: str = "faulty") -> dict:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30000)
    sock.connect(endpoint)
    try:
        header = {"v": 1, "op": "infer", "id": 1, "args": {"model": model, "inputs": inputs}}
        sock.send_multipart([msgpack.packb(header), *frames])
        return msgpack.unpackb(sock.recv_multipart()[0], raw=False)
    finally:
        sock.close()


def _input(shape, datatype="FP32", name="features") -> dict:
    return {"name": name, "datatype": datatype, "shape": list(shape)}


def _trigger(value: float) -> np.ndarray:
    x = features(3)
    x[1, 0] = value
    return x


HOSTILE = {
    "wrong dtype": ([_input((1, 256), "FP64")], [features(1).astype(np.float64).tobytes()], codes.BAD_INPUT),
    "wrong shape": ([_input((1, 128))], [features(1)[:, :128].tobytes()], codes.BAD_INPUT),
    "wrong byte count": ([_input((2, 256))], [features(1).tobytes()], codes.BAD_INPUT),
    "unknown input name": ([_input((1, 256), name="salary")], [features(1).tobytes()], codes.BAD_INPUT),
    "2^40-element shape": ([_input((1 << 20, 1 << 20))], [b"\0" * 64], codes.BAD_INPUT),
    "frames missing": ([_input((1, 256))], [], codes.BAD_INPUT),
    "unknown datatype": ([_input((1, 256), "BF16")], [features(1).tobytes()], codes.BAD_INPUT),
    "raising handler": ([_input((3, 256))], [_trigger(faulty_handlers.RAISE).tobytes()], codes.INTERNAL),
    "handler calling sys.exit": ([_input((3, 256))], [_trigger(faulty_handlers.EXIT).tobytes()], codes.INTERNAL),
    "wrong batch size": ([_input((3, 256))], [_trigger(faulty_handlers.WRONG_ROWS).tobytes()], codes.INTERNAL),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_input_fails_alone(daemon, case):
    inputs, frames, code = HOSTILE[case]
    pid = worker_pid(daemon, "faulty")
    good = features(2, seed=1)
    client = daemon.client()
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(raw_infer, daemon.endpoint, inputs, frames)
        fine = pool.submit(client.infer, "faulty", {"features": good})
        reply, result = bad.result(), fine.result()
    assert reply["kind"] == "error" and reply["code"] == code, reply
    assert reply["message"]
    rules = faulty_handlers.Faulty()
    rules.setup("cpu", {})
    np.testing.assert_allclose(result.outputs["score"], rules.predict({"features": good})["score"], rtol=1e-6)
    assert worker_pid(daemon, "faulty") == pid


def test_a_hanging_handler_ends_in_deadline_exceeded_and_its_worker_restarts(daemon):
    pid = worker_pid(daemon, "stuck")
    client = daemon.client()
    with pytest.raises(MCPDError) as hung:
        client.infer("stuck", {"features": _trigger(faulty_handlers.HANG)}, timeout_ms=500)
    assert hung.value.code == codes.DEADLINE_EXCEEDED
    daemon.wait_until(lambda: _restarted(daemon, pid), timeout=60, what="the stuck worker's restart")
    result = client.infer("stuck", {"features": features(2)})
    assert result.outputs["score"].shape == (2,)


def _restarted(daemon, pid: int) -> bool:
    try:
        return worker_pid(daemon, "stuck") not in (pid, None)
    except (IndexError, KeyError):
        return False   # between the old worker's loss and the new one's hello


def test_a_handler_that_cannot_load_refuses_the_start_with_the_reason(fresh_daemon):
    d = fresh_daemon(started=False, **{"pool": {"shared": False}, "models.risk": {},
                                      "models.risk.versions.v1": {"handler": "mcpd.handlers.examples.risk_scorer:Nope"}})
    d.start(wait=False)
    assert d.process.wait(120) == 2
    assert "handler 'mcpd.handlers.examples.risk_scorer:Nope'" in d.log()
    assert "has no Handler subclass Nope" in d.log()


def test_a_handler_that_calls_sys_exit_refuses_the_start_with_the_reason(fresh_daemon):
    """SystemExit is the handler's code too: the start is refused, not a worker restarted forever."""
    d = fresh_daemon(started=False, **{"pool": {"shared": False}, "models.risk": {},
                                      "models.risk.versions.v1": {"handler": "faulty_handlers:ExitsInSetup"}})
    d.environment["PYTHONPATH"] = f"{REPO}:{REPO / 'tests'}"
    d.start(wait=False)
    assert d.process.wait(120) == 2
    assert "SystemExit: this handler exits on purpose" in d.log()
