"""The scheduler's core in-process: messages and a clock in, messages out, no sockets. What
crosses processes (real kills, restarts, replies reaching clients) stays with the daemon tests."""
import tempfile

import msgspec
import numpy as np
import pytest

from mcpd.config import from_dict
from mcpd.daemon import messages
from mcpd.daemon.child_stats import EdgeShedState, WorkerStats
from mcpd.daemon.scheduler.core import Scheduler
from mcpd.daemon.scheduler.edge_shedding import LEASE_S, MIN_LATE
from mcpd.protocol import codes
from mcpd.protocol.args import ContextOpenArgs, GenerateArgs, PingArgs
from mcpd.protocol.control_args import ContextListing, ContextRef
from mcpd.protocol.results import Degraded, GenerateResult, Usage
from mcpd.protocol.sampling import SamplingParams
from fakes import Clock, Ports, decoded, scheduler_of

WORKER = b"w0"


@pytest.fixture
def core():
    runtime_dir = tempfile.mkdtemp(prefix="mcpd-c-", dir="/tmp")
    config = from_dict({"server": {"runtime_dir": runtime_dir}, "cache": {"enabled": False},
                        "persistence": {"enabled": False}})
    ports, clock = Ports(), Clock()
    return scheduler_of(config, ports, clock)


def request(rid: int, args, timeout_ms: int | None = None, tenant: str = "t") -> list[bytes]:
    return messages.encode(messages.Request(rid, rid, tenant, None, timeout_ms, args))


def hello(core, pid: int) -> None:
    core.on_worker(WORKER, *decoded(messages.encode(messages.Hello(0, pid, "cpu", "model", "float32", "default", "default"))))


def from_worker(core, message, *payload) -> None:
    core.on_worker(WORKER, *decoded(messages.encode(message, *payload)))


def result(token_ids: list[int], text: str = "") -> GenerateResult:
    """A worker's generate result, as a turn's TurnResult carries it."""
    return GenerateResult(text, token_ids, "length", "default", "default", Usage(1, len(token_ids)))


def dispatched(core) -> list[messages.Dispatch]:
    return [m for _, m, _ in core.ports.workers if isinstance(m, messages.Dispatch)]


def test_a_request_waits_for_a_worker_then_goes_to_it_as_a_typed_dispatch(core):
    args = GenerateArgs(prompt="hello", sampling=SamplingParams(max_tokens=3))
    core.on_inbox(*decoded(request(1, args)))
    core.tick()
    assert dispatched(core) == [] and len(core.queue) == 1
    hello(core, 11)
    core.tick()
    rank = core.config.scheduler.classes[core.config.scheduler.default_class].rank
    bos_hello = [256, *b"hello"]   # tokenized here, once: the embedded model's byte tokenizer
    assert dispatched(core) == [messages.Dispatch(1, 1, "t", rank, False, args, bos_hello)]


def test_a_workers_hello_is_welcomed_and_so_is_a_worker_a_restarted_scheduler_meets_by_its_stats(core):
    hello(core, 11)
    assert [(identity, type(m)) for identity, m, _ in core.ports.workers] == [(WORKER, messages.Welcome)]
    other = b"w1"   # said hello to the scheduler before this one: its stats are the first word heard
    stats = WorkerStats(index=1, pid=12, device="cpu", model="model", dtype="float32")
    core.on_worker(other, *decoded(messages.encode(messages.Stats(stats))))
    assert [(identity, type(m)) for identity, m, _ in core.ports.workers][1:] == [(other, messages.Welcome)]
    assert core.workers[other].ready and core.workers[other].pid == 12


def test_waiting_requests_go_to_a_worker_in_one_send_and_what_its_full_queue_refused_goes_next(core):
    hello(core, 11)
    welcome_sends = core.ports.worker_sends
    for rid in (1, 2, 3):
        core.on_inbox(*decoded(request(rid, PingArgs())))
    core.ports.worker_room = 2
    core.tick()
    assert [d.rid for d in dispatched(core)] == [1, 2] and core.ports.worker_sends == welcome_sends + 1
    assert [job.rid for job in core.workers[WORKER].jobs.values()] == [1, 2] and len(core.queue) == 1
    core.ports.worker_room = None
    core.tick()
    assert [d.rid for d in dispatched(core)] == [1, 2, 3] and len(core.queue) == 0


def test_a_request_lost_with_its_worker_runs_again_alone_then_is_answered_and_remembered(core):
    hello(core, 11)
    core.on_inbox(*decoded(request(1, GenerateArgs(prompt="poison"))))
    core.tick()
    core.on_inbox(*decoded(messages.encode(messages.WorkerLost(0, 11))))
    assert core.ports.finals() == {} and core.queue.peek(core.clock()).suspect   # requeued, nothing answered
    hello(core, 12)   # the restarted worker
    core.tick()
    assert [d.rid for d in dispatched(core)] == [1, 1]
    core.on_inbox(*decoded(messages.encode(messages.WorkerLost(0, 12))))
    final = core.ports.finals()[1]
    assert final["code"] == codes.WORKER_LOST and "died twice" in final["message"]
    core.on_inbox(*decoded(request(2, GenerateArgs(prompt="poison"))))   # sent again: refused at once
    assert core.ports.finals()[2]["code"] == codes.INTERNAL and len(dispatched(core)) == 2


def test_a_request_that_streamed_is_answered_when_its_worker_dies(core):
    hello(core, 11)
    core.on_inbox(*decoded(request(1, GenerateArgs(prompt="x", stream=True))))
    core.tick()
    from_worker(core, messages.Started(1))
    core.on_inbox(*decoded(messages.encode(messages.WorkerLost(0, 11))))
    assert core.ports.finals()[1]["code"] == codes.WORKER_LOST and len(core.queue) == 0


def test_a_lost_worker_note_about_an_older_incarnation_changes_nothing(core):
    hello(core, 11)
    core.on_inbox(*decoded(request(1, PingArgs())))
    core.tick()
    core.on_inbox(*decoded(messages.encode(messages.WorkerLost(0, 10))))
    assert core.workers[WORKER].jobs.keys() == {1} and core.ports.finals() == {}


def test_deadlines_answer_a_waiting_request_and_cancel_a_running_one(core):
    core.on_inbox(*decoded(request(1, GenerateArgs(prompt="x"), timeout_ms=50)))
    core.clock.now += 0.049
    core.tick()
    assert core.ports.finals() == {}
    core.clock.now += 0.002
    core.tick()
    assert core.ports.finals()[1]["code"] == codes.DEADLINE_EXCEEDED
    hello(core, 11)
    core.on_inbox(*decoded(request(2, GenerateArgs(prompt="x"), timeout_ms=50)))
    core.tick()
    core.clock.now += 0.051
    core.tick()
    cancels = [m for _, m, _ in core.ports.workers if isinstance(m, messages.Cancel)]
    assert cancels == [messages.Cancel(2, codes.DEADLINE_EXCEEDED)] and 2 not in core.ports.finals()


def test_a_context_turn_runs_on_the_history_and_is_committed_before_its_reply(core):
    hello(core, 11)
    core.on_inbox(*decoded(request(1, ContextOpenArgs(id="chat"))))
    assert core.ports.finals()[1]["result"]["version"] == 0
    core.on_inbox(*decoded(request(2, GenerateArgs(prompt="hi", context="chat", base=0))))
    core.tick()
    turn = dispatched(core)[0]
    assert turn.turn and core.ports.workers[1][2] == [b""]   # [0]: the Welcome; an empty history: one empty int32 frame
    core.on_inbox(*decoded(request(3, GenerateArgs(prompt="again", context="chat"))))   # busy with the turn
    assert core.ports.finals()[3]["code"] == codes.CONFLICT
    from_worker(core, messages.TurnResult(2, result([7], "ok"), [104, 105, 7]))
    reply = core.ports.finals()[2]
    assert reply["result"]["context"] == {"id": "chat", "version": 1, "appended_token_ids": [104, 105, 7]}
    core.on_inbox(*decoded(request(4, GenerateArgs(context="chat"))))   # free again; runs on the committed tokens
    core.tick()
    assert core.ports.workers[-1][2] == [np.array([104, 105, 7], np.int32).tobytes()]
    assert dispatched(core)[-1].prompt_ids == []


def test_a_turn_on_a_history_is_tokenized_without_bos_and_a_refused_one_frees_the_context(core):
    hello(core, 11)
    core.on_inbox(*decoded(request(1, ContextOpenArgs(id="chat"))))
    core.on_inbox(*decoded(request(2, GenerateArgs(prompt="hi", context="chat", base=0))))
    core.tick()
    assert dispatched(core)[0].prompt_ids == [256, *b"hi"]   # the first turn opens the sequence
    from_worker(core, messages.TurnResult(2, result([7], "ok"), [256, *b"hi", 7]))
    core.on_inbox(*decoded(request(3, GenerateArgs(prompt="x" * 40_000, context="chat"))))   # over max_prompt_tokens
    assert core.ports.finals()[3]["code"] == codes.BAD_REQUEST
    core.on_inbox(*decoded(request(4, GenerateArgs(prompt="more", context="chat"))))   # the refusal ended its turn
    core.tick()
    assert dispatched(core)[-1].prompt_ids == list(b"more")


def test_a_restarted_scheduler_learns_a_worker_from_its_typed_stats(core):
    """The worker said hello to the scheduler before this one: its next Stats bring it back."""
    stats = WorkerStats(index=0, pid=11, device="cpu", model="m", dtype="float32", running=0, kv_blocks_total=9)
    from_worker(core, messages.Stats(stats))
    core.on_inbox(*decoded(request(1, PingArgs())))
    core.tick()
    assert [d.rid for d in dispatched(core)] == [1]
    from_worker(core, messages.Stats(msgspec.structs.replace(stats, running=3)))
    [worker] = core.stats()["workers"]
    assert (worker.pid, worker.model, worker.running, worker.kv_blocks_total) == (11, "m", 3, 9)


def test_admission_counts_real_prompt_tokens(core):
    five = SamplingParams(max_tokens=5)
    core.on_inbox(*decoded(request(1, GenerateArgs(prompt="é" * 10, sampling=five))))   # 10 characters, 20 bytes
    core.on_inbox(*decoded(request(2, GenerateArgs(prompt_token_ids=[1, 2, 3], sampling=five))))
    core.on_inbox(*decoded(request(3, GenerateArgs(prompt="x" * 40_000))))
    assert core.jobs[1].cost == 1 + 20 + 5 and core.jobs[1].length_bin == (21).bit_length()
    assert core.jobs[2].cost == 3 + 5
    reply = core.ports.finals()[3]
    assert reply["code"] == codes.BAD_REQUEST and "limit is 32768" in reply["message"]


def test_under_overload_the_ladder_shortens_the_args_it_dispatches_and_says_so():
    """The cap is a rewrite of max_tokens in the request's own sampling struct, not a value beside it."""
    runtime_dir = tempfile.mkdtemp(prefix="mcpd-c-", dir="/tmp")
    config = from_dict({"server": {"runtime_dir": runtime_dir}, "cache": {"enabled": False},
                        "persistence": {"enabled": False},
                        "scheduler": {"degrade_queue_depth": 2, "degrade_after_s": 1.0}})
    core = scheduler_of(config, Ports(), Clock())
    asked = SamplingParams(max_tokens=1000, temperature=0.5, seed=7)
    for rid in (1, 2):   # no worker yet: they wait, and the queue is at the ladder's depth
        core.on_inbox(*decoded(request(rid, GenerateArgs(prompt="x", sampling=asked))))
    core.tick()
    core.clock.now += 1.0   # overloaded this long: the ladder caps classes that set degrade_max_tokens
    core.on_inbox(*decoded(messages.encode(messages.Request(3, 3, "t", "low", None, GenerateArgs(prompt="x", sampling=asked)))))
    hello(core, 11)
    core.tick()
    sent = {d.rid: d for d in dispatched(core)}
    cap = config.scheduler.classes["low"].degrade_max_tokens
    assert sent[3].args.sampling == SamplingParams(max_tokens=cap, temperature=0.5, seed=7)
    assert sent[3].degraded == Degraded(cap, 1000)
    assert sent[1].args.sampling == asked and sent[1].degraded is None   # its class is never capped


def test_apply_config_swaps_classes_and_keeps_queued_work(core):
    core.on_inbox(*decoded(request(7, PingArgs())))   # no worker: it waits
    assert len(core.queue) == 1
    fresh = from_dict({"server": {"runtime_dir": str(core.config.runtime_dir)}, "cache": {"enabled": False},
                       "persistence": {"enabled": False}, "scheduler": {"window_max_ms": 5.0, "default_class": "bulk",
                                                                       "classes": {"normal": {"rank": 1, "rate": 3.0},
                                                                                   "bulk": {"rank": 0}}}})
    changed = core.apply_config(fresh)
    assert changed == ["scheduler.default_class", "scheduler.window_max_ms", "scheduler.classes"]
    assert len(core.queue) == 1 and core.queue.peek(0.0).rid == 7
    assert set(core.stats()["classes"]) >= {"normal", "bulk"}
    assert core.admission.class_of(None) == "bulk"
    assert core.apply_config(fresh) == []


def test_a_control_op_that_raises_answers_internal_and_the_scheduler_goes_on(core, monkeypatch):
    def broken_drop(owner, id):
        raise RuntimeError("injected fault in the store")
    core.contexts.store.open("t", "kept", True)
    monkeypatch.setattr(core.contexts.store, "drop", broken_drop)
    admin = lambda token, op, args: core.on_inbox(*decoded(messages.encode(messages.Admin(token, op, args))))   # noqa: E731
    admin(1, "contexts.drop", ContextRef(owner="t", id="kept"))
    admin(2, "contexts.list", ContextListing(owner="t", limit=10))
    replies = {e.token: e for e in core.ports.events.sent if isinstance(e, messages.AdminAnswer)}
    assert replies[1].error.code == codes.INTERNAL and "injected fault" in replies[1].error.message
    assert replies[2].result.total == 1


def windowed_core(window_max_ms: float) -> Scheduler:
    """A core whose normal class's batching window is already open at window_max_ms."""
    runtime_dir = tempfile.mkdtemp(prefix="mcpd-c-", dir="/tmp")
    config = from_dict({"server": {"runtime_dir": runtime_dir}, "cache": {"enabled": False},
                        "persistence": {"enabled": False},
                        "scheduler": {"window_min_ms": window_max_ms, "window_max_ms": window_max_ms}})
    return scheduler_of(config, Ports(), Clock())


def test_a_prefill_waits_out_an_open_window_while_the_worker_is_busy():
    core = windowed_core(10.0)
    hello(core, 11)
    core.on_inbox(*decoded(request(1, GenerateArgs(prompt="first", sampling=SamplingParams(max_tokens=50)))))   # idle: never held
    core.tick()
    core.on_inbox(*decoded(request(2, GenerateArgs(prompt="second", sampling=SamplingParams(max_tokens=1)))))
    core.tick()
    assert [d.rid for d in dispatched(core)] == [1]
    core.clock.now += 0.011
    core.tick()
    assert [d.rid for d in dispatched(core)] == [1, 2]


def test_by_default_a_prefill_goes_to_a_busy_worker_at_once():
    """The window is off by default: the worker groups what arrives during a step by itself."""
    core = windowed_core(0.0)
    assert core.config.scheduler.window_max_ms == from_dict({}).scheduler.window_max_ms == 0
    hello(core, 11)
    core.on_inbox(*decoded(request(1, GenerateArgs(prompt="first", sampling=SamplingParams(max_tokens=50)))))
    core.tick()
    core.on_inbox(*decoded(request(2, GenerateArgs(prompt="second", sampling=SamplingParams(max_tokens=1)))))
    core.tick()
    assert [d.rid for d in dispatched(core)] == [1, 2]


def test_pings_in_flight_leave_the_worker_idle_for_the_window():
    """A ping's Done note may come a moment late (worker/done_notes.py): the pings still in the
    books are no work, and a prefill on that worker is not held."""
    core = windowed_core(10.0)
    hello(core, 11)
    core.on_inbox(*decoded(request(1, PingArgs())))
    core.tick()
    core.on_inbox(*decoded(request(2, GenerateArgs(prompt="second", sampling=SamplingParams(max_tokens=1)))))
    core.tick()
    assert [d.rid for d in dispatched(core)] == [1, 2]


def arrival(rid: int, priority: str, received: float) -> list[bytes]:
    """A request the front-end read at `received` (the scheduler's clock: both are CLOCK_MONOTONIC)."""
    return messages.encode(messages.Request(rid, rid, "t", priority, None, PingArgs(), received=received))


def refused(core) -> dict[int, str]:
    return {rid: reply["code"] for rid, reply in core.ports.finals().items()}


def test_a_backlog_on_the_way_to_the_scheduler_sheds_low_here_and_at_the_front_end_and_never_high(core):
    """The wait is the front-end's stamp to this read: MIN_LATE requests in a row that waited past
    shed_wait_ms are a backlog, and every late low behind them is refused while high still queues;
    a low read on time found the backlog gone (the front-end's cap keeps it so) and is queued."""
    late = core.clock.now - 2 * core.config.scheduler.shed_wait_ms / 1000
    first = MIN_LATE
    for rid in range(first):   # one late fewer than MIN_LATE, then one on time: a scheduler descheduled a moment
        core.on_inbox(*decoded(arrival(rid, "low", core.clock.now if rid == first - 1 else late)))
    core.tick()
    assert refused(core) == {} and core.ports.frontend == []
    found = first + MIN_LATE - 1   # MIN_LATE late in a row: a backlog, found on the last, shed at once
    for rid in range(first, found + 1):
        core.on_inbox(*decoded(arrival(rid, "low", late)))
    core.on_inbox(*decoded(arrival(100, "high", late)))
    core.on_inbox(*decoded(arrival(101, "low", late)))
    core.on_inbox(*decoded(arrival(102, "low", core.clock.now)))   # on time: admitted under the front-end's cap, served
    core.tick()
    assert refused(core) == {found: codes.OVERLOADED, 101: codes.OVERLOADED}
    sched = core.config.scheduler
    assert [m for m, _ in core.ports.frontend if isinstance(m, messages.Shed)] == \
        [messages.Shed(["low"], sched.overloaded_retry_ms, round(LEASE_S * 1000), sched.shed_in_flight)]
    assert core.queue.depth("high") == 1 and core.queue.depth("low") == found + 1
    assert core.stats()["edge_shed"] == EdgeShedState(active=True, entered=1)
    core.clock.now += LEASE_S   # no backlog since: the lease ends by itself
    core.on_inbox(*decoded(arrival(103, "low", late)))
    assert 103 not in refused(core) and core.stats()["edge_shed"].active is False
