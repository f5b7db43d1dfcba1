"""The scheduler's core with a handler model beside a language model, in-process: an infer goes
to its version's workers with its input frames, costs its rows, and a handler lane holds enough
requests per worker to fill batches; each kind's op is refused on the other kind; a flood on a
full queue is refused without a pass over the workers' jobs for each arrival."""
import tempfile

import pytest

from mcpd.config import from_dict
from mcpd.daemon import messages, model_stats
from mcpd.daemon.scheduler import core as scheduler_core
from mcpd.daemon.scheduler.poison import PoisonList
from mcpd.handlers.tensor_header import TensorHeader
from mcpd.protocol import codes
from mcpd.protocol.args import GenerateArgs, InferArgs
from fakes import Clock, Ports, decoded, scheduler_of
from test_scheduler_core import request

MAX_BATCH = 8
SIGNATURE = model_stats.Signature({"features": model_stats.TensorMetadata("FP32", [-1, 4])},
                               {"score": model_stats.TensorMetadata("FP32", [-1])})


@pytest.fixture
def core():
    config = from_dict({
        "server": {"runtime_dir": tempfile.mkdtemp(prefix="mcpd-c-", dir="/tmp")}, "cache": {"enabled": False},
        "persistence": {"enabled": False}, "scheduler": {"max_inflight_per_worker": 2},
        "routing": {"default_model": "risk"},
        "models": {"chat": {"versions": {"v1": {}}},
                   "risk": {"versions": {"v1": {"handler": "mcpd.handlers.examples.risk_scorer:RiskRules",
                                                "batching": {"max_batch_size": MAX_BATCH}}}}}})
    core = scheduler_of(config, Ports(), Clock())
    core.on_worker(b"w0", *decoded(messages.encode(messages.Hello(0, 100, "cpu", "x", "float32", "chat", "v1"))))
    core.on_worker(b"w1", *decoded(messages.encode(messages.Hello(1, 101, "cpu", "h", "", "risk", "v1", SIGNATURE))))
    return core


def infer(rows: int, **args) -> InferArgs:
    return InferArgs(inputs=(TensorHeader("features", "FP32", (rows, 4)),), **args)


def test_an_infer_goes_to_its_handlers_worker_with_its_frames_and_costs_its_rows(core):
    frame = bytes(3 * 4 * 4)
    core.on_inbox(*decoded(request(1, infer(3)) + [frame]))   # no model: the default, a handler model
    core.tick()
    [(identity, dispatch, payload)] = [w for w in core.ports.workers if isinstance(w[1], messages.Dispatch)]
    assert identity == b"w1" and dispatch.args == infer(3) and payload == [frame]
    assert core.workers[b"w1"].outstanding_tokens == 3


def test_a_handler_lane_holds_two_batches_per_worker(core):
    for rid in range(3 * MAX_BATCH):
        core.on_inbox(*decoded(request(rid, infer(1)) + [bytes(16)]))
    core.tick()
    assert len(core.workers[b"w1"].jobs) == 2 * MAX_BATCH   # not scheduler.max_inflight_per_worker (2)
    assert core.queue.waiting_for(("risk", "v1")) == MAX_BATCH


@pytest.mark.parametrize("args, words", [
    (infer(1, model="chat"), "model 'chat' is a language model: use generate"),
    (GenerateArgs(prompt="x", model="risk"), "model 'risk' is a handler model: use infer"),
])
def test_an_op_for_the_other_kind_is_refused_naming_it(core, args, words):
    core.on_inbox(*decoded(request(1, args)))
    final = core.ports.finals()[1]
    assert final["code"] == codes.BAD_REQUEST and words in final["message"], final
    assert not core.jobs


def test_status_shows_each_versions_kind_and_the_handlers_signature(core):
    models = core.stats()["models"].models
    assert models["chat"].versions["v1"].kind == "language"
    assert models["chat"].versions["v1"].signature is None
    assert models["risk"].versions["v1"].kind == "handler"
    assert models["risk"].versions["v1"].signature == SIGNATURE


def test_a_poisoned_infer_is_known_by_its_inputs_bytes_not_its_header_alone():
    poison, admitted = PoisonList(), messages.Request(1, 1, "t", None, None, infer(1))
    poison.add(admitted, now=0.0, payload=[b"breaks the worker"])
    assert poison.holds(admitted, 1.0, [b"breaks the worker"])
    assert not poison.holds(admitted, 1.0, [b"another row of the same shape"])


FLOOD_QUEUE = 4   # scheduler.max_queue of the flood's core: small, so that a few requests fill it


@pytest.fixture
def flooded(monkeypatch):
    """A handler lane whose worker holds its two batches and whose queue is full; the core's
    looks at the waiting jobs during admission (dispatch_waiting, the real one) are counted."""
    config = from_dict({
        "server": {"runtime_dir": tempfile.mkdtemp(prefix="mcpd-c-", dir="/tmp")}, "cache": {"enabled": False},
        "persistence": {"enabled": False}, "scheduler": {"max_queue": FLOOD_QUEUE, "max_inflight_per_worker": 2},
        "models": {"risk": {"versions": {"v1": {"handler": "mcpd.handlers.examples.risk_scorer:RiskRules",
                                                "batching": {"max_batch_size": MAX_BATCH}}}}}})
    core = scheduler_of(config, Ports(), Clock())
    core.on_worker(b"w1", *decoded(messages.encode(messages.Hello(1, 101, "cpu", "h", "", "risk", "v1", SIGNATURE))))
    for rid in range(2 * MAX_BATCH + FLOOD_QUEUE):
        core.on_inbox(*decoded(request(rid, infer(1, model="risk")) + [bytes(16)]))
    core.tick()
    assert len(core.workers[b"w1"].jobs) == 2 * MAX_BATCH and len(core.queue) == FLOOD_QUEUE
    looks = []
    real = scheduler_core.dispatch_waiting
    monkeypatch.setattr(scheduler_core, "dispatch_waiting", lambda *args: looks.append(1) or real(*args))
    return core, looks


def refused(core, rid: int) -> bool:
    return any(isinstance(m, messages.Final) and m.rid == rid and m.code == codes.OVERLOADED
               for m, _ in core.ports.frontend)


def test_a_flood_on_a_full_queue_is_refused_without_a_look_at_the_workers_until_one_frees_room(flooded):
    core, looks = flooded
    flood = range(100, 100 + 50)
    for rid in flood:
        core.on_inbox(*decoded(request(rid, infer(1, model="risk")) + [bytes(16)]))
    assert all(refused(core, rid) for rid in flood)
    assert looks == []   # nothing freed a worker's room since the last look: no pass over its jobs
    core.on_worker(b"w1", *decoded(messages.encode(messages.Done([0]))))
    core.on_inbox(*decoded(request(200, infer(1, model="risk")) + [bytes(16)]))
    assert looks == [1] and not refused(core, 200)   # a waiting job took the seat; the newcomer its place
    assert 200 in core.jobs and len(core.workers[b"w1"].jobs) == 2 * MAX_BATCH
