"""The scheduler's core with a model table, in-process: each version's requests go to its own
workers in their own lane, and an unload is answered once the version's requests are done."""
import tempfile

import pytest

from mcpd.config import PriorityClass, from_dict
from mcpd.daemon import messages
from mcpd.daemon.child_stats import FastRungState
from mcpd.daemon.scheduler.core import Scheduler
from mcpd.daemon.scheduler.fast_rung import FastRung
from mcpd.protocol import codes
from mcpd.protocol.args import ContextOpenArgs, GenerateArgs, PingArgs
from mcpd.protocol.control_args import ModelVersion
from fakes import Clock, Ports, decoded, scheduler_of
from test_scheduler_core import request, result


@pytest.fixture
def core():
    runtime_dir = tempfile.mkdtemp(prefix="mcpd-c-", dir="/tmp")
    config = from_dict({"server": {"runtime_dir": runtime_dir}, "cache": {"enabled": False},
                        "persistence": {"enabled": False}, "scheduler": {"max_inflight_per_worker": 1},
                        "models": {"m": {"default": "a", "versions": {"a": {}, "b": {}}}}})
    return scheduler_of(config, Ports(), Clock())


def hello(core, index: int, version: str) -> None:
    identity = b"w%d" % index
    core.on_worker(identity, *decoded(messages.encode(messages.Hello(index, 100 + index, "cpu", "x", "float32", "m", version))))


def sent_to(core) -> dict[int, bytes]:
    return {m.rid: identity for identity, m, _ in core.ports.workers if isinstance(m, messages.Dispatch)}


def test_requests_go_to_their_versions_workers_and_a_full_version_blocks_no_other(core):
    hello(core, 0, "a")
    hello(core, 1, "b")
    for rid, version in ((1, "b"), (2, "b"), (3, "a")):   # b's second waits: its worker is full
        core.on_inbox(*decoded(request(rid, GenerateArgs(prompt="x", version=version))))
    core.tick()
    assert sent_to(core) == {1: b"w1", 3: b"w0"} and core.queue.waiting_for(("m", "b")) == 1


def unload_answers(core) -> list[tuple[int, bool]]:
    return [(e.token, e.result.loaded) for e in core.ports.events.sent if isinstance(e, messages.AdminAnswer)]


def flushes(core) -> list[bytes]:
    return [identity for identity, m, _ in core.ports.workers if isinstance(m, messages.Flush)]


def test_an_unload_is_answered_once_the_versions_requests_are_done_and_their_finals_relayed(core):
    hello(core, 0, "a")
    hello(core, 1, "b")
    core.on_inbox(*decoded(request(1, GenerateArgs(prompt="x", version="b"))))
    core.on_inbox(*decoded(request(2, GenerateArgs(prompt="x", version="b"))))
    core.tick()
    core.on_inbox(*decoded(messages.encode(messages.Admin(7, "models.unload", ModelVersion("m", "b")))))
    core.on_inbox(*decoded(request(3, GenerateArgs(prompt="x", version="b"))))   # after the op: refused
    assert core.ports.finals()[3]["code"] == codes.UNKNOWN_MODEL
    core.on_worker(b"w1", *decoded(messages.encode(messages.Done([1]))))
    core.tick()   # request 2, queued before the op, still runs on b
    assert unload_answers(core) == [] and sent_to(core)[2] == b"w1"
    core.on_worker(b"w1", *decoded(messages.encode(messages.Done([2]))))
    core.tick()   # its final may still be on its way to the front-end
    assert unload_answers(core) == [] and flushes(core) == [b"w1"]
    core.on_inbox(*decoded(messages.encode(messages.Flushed(1))))
    core.tick()
    assert unload_answers(core) == [(7, False)]


def test_a_worker_lost_while_its_version_flushes_holds_no_unload_and_pings_avoid_it(core):
    hello(core, 0, "b")   # the first a ping would go to
    hello(core, 1, "a")
    core.on_inbox(*decoded(messages.encode(messages.Admin(7, "models.unload", ModelVersion("m", "b")))))
    assert flushes(core) == [b"w0"]
    core.on_inbox(*decoded(request(1, PingArgs())))
    core.tick()
    assert sent_to(core) == {1: b"w1"}   # not to b's worker: its Flushed must come after its last reply
    core.on_inbox(*decoded(messages.encode(messages.WorkerLost(0, 100))))
    core.tick()
    assert unload_answers(core) == [(7, False)]


def test_an_unload_sent_again_asks_again_and_a_full_worker_queue_is_asked_later(core):
    hello(core, 0, "a")
    hello(core, 1, "b")
    core.ports.worker_room = 0   # b's worker takes nothing for now
    core.on_inbox(*decoded(messages.encode(messages.Admin(7, "models.unload", ModelVersion("m", "b")))))
    assert flushes(core) == [] and unload_answers(core) == []
    core.ports.worker_room = None
    core.tick()
    assert flushes(core) == [b"w1"]
    # its marker lost (a front-end restarting, say): the op times out and is sent again
    core.on_inbox(*decoded(messages.encode(messages.Admin(8, "models.unload", ModelVersion("m", "b")))))
    assert flushes(core) == [b"w1", b"w1"]
    core.on_inbox(*decoded(messages.encode(messages.Flushed(1))))
    core.tick()
    assert unload_answers(core) == [(7, False), (8, False)]


def test_a_context_turn_remembers_the_version_that_holds_its_kv(core):
    hello(core, 0, "a")
    hello(core, 1, "b")
    core.on_inbox(*decoded(request(9, ContextOpenArgs(id="c"))))
    for rid, version in ((1, "a"), (2, "b")):
        core.on_inbox(*decoded(request(rid, GenerateArgs(prompt="x", context="c", version=version))))
        core.tick()
        context = core.contexts.store.get("t", "c")
        assert context.kv_version == f"m/{version}"
        core.on_worker(b"w%d" % (rid - 1), *decoded(messages.encode(messages.TurnResult(rid, result([]), [5]))))


def shadowed_core(fraction: float):
    runtime_dir = tempfile.mkdtemp(prefix="mcpd-c-", dir="/tmp")
    config = from_dict({"server": {"runtime_dir": runtime_dir}, "cache": {"enabled": False},
                        "persistence": {"enabled": False},
                        "models": {"m": {"default": "a", "shadow": "b", "shadow_fraction": fraction,
                                         "versions": {"a": {}, "b": {}}}}})
    core = scheduler_of(config, Ports(), Clock())
    hello(core, 0, "a")
    hello(core, 1, "b")
    return core


def test_a_shadowed_request_runs_on_both_versions_and_only_the_primary_answers():
    core = shadowed_core(1.0)
    core.on_inbox(*decoded(request(1, GenerateArgs(prompt="x", stream=True))))
    core.tick()
    sent = {identity: m for identity, m, _ in core.ports.workers if isinstance(m, messages.Dispatch)}
    primary, shadow = sent[b"w0"], sent[b"w1"]
    assert primary.compare and shadow.compare and shadow.rid < 0 and shadow.args.version == "b"
    assert not shadow.args.stream and shadow.args.sampling.logprobs and shadow.rank < primary.rank
    core.on_worker(b"w1", *decoded(messages.encode(messages.TurnResult(shadow.rid, result([1, 2, 9]), []))))
    assert core.ports.finals() == {}   # the shadow's answer goes to no client
    core.on_worker(b"w0", *decoded(messages.encode(messages.TurnResult(1, result([1, 2, 3]), []))))
    assert core.ports.finals()[1]["result"]["token_ids"] == [1, 2, 3]
    figures = core.models_stats().models["m"].shadow
    assert (figures.compared, figures.identical, figures.mean_first_divergence) == (1, 0, 2.0)


def test_shadows_follow_their_fraction_and_are_shed_when_the_queue_is_deep():
    core = shadowed_core(0.25)
    for rid in range(1, 9):
        core.on_inbox(*decoded(request(rid, GenerateArgs(prompt="x"))))
    assert core.models_stats().models["m"].shadow.started == 2
    core.apply_config(from_dict({"server": {"runtime_dir": core.config.server.runtime_dir}, "cache": {"enabled": False},
                                 "persistence": {"enabled": False}, "scheduler": {"degrade_queue_depth": 1},
                                 "models": {"m": {"default": "a", "shadow": "b", "shadow_fraction": 0.25,
                                                  "versions": {"a": {}, "b": {}}}}}))
    for rid in range(9, 17):
        core.on_inbox(*decoded(request(rid, GenerateArgs(prompt="x"))))
    figures = core.models_stats().models["m"].shadow
    assert (figures.started, figures.shed) == (2, 2)


def test_the_fast_rung_sends_a_slow_class_to_the_fast_version_and_leaves_with_hysteresis():
    rung, cls = FastRung(), PriorityClass(fast_above_ms=10.0)
    rung.update("normal", cls, 12.0)
    assert rung.goes_fast("normal", cls, {"prefer_speed": True}) and not rung.goes_fast("normal", cls, None)
    rung.update("normal", cls, 6.0)   # below the target, not yet below half of it: stays
    assert rung.goes_fast("normal", cls, {"prefer_speed": True})
    rung.update("normal", cls, 4.0)
    assert not rung.goes_fast("normal", cls, {"prefer_speed": True}) and rung.describe() == FastRungState([], 1)
    everyone = PriorityClass(fast_above_ms=10.0, fast_all=True)
    rung.update("low", everyone, 11.0)
    assert rung.goes_fast("low", everyone, None)


def fast_model_config(runtime_dir: str, fast_above_ms: float):
    classes = {"normal": {"rank": 1, "fast_above_ms": fast_above_ms}}
    return from_dict({"server": {"runtime_dir": runtime_dir}, "cache": {"enabled": False},
                      "persistence": {"enabled": False}, "scheduler": {"classes": classes},
                      "models": {"m": {"default": "a", "fast": "b", "versions": {"a": {}, "b": {}}}}})


def class_waited_20_ms(fast_above_ms: float) -> Scheduler:
    """A core whose class "normal" measured a queueing p99 of 20 ms: one window adjustment's worth
    of requests, each dispatched 20 ms after it came."""
    config = fast_model_config(tempfile.mkdtemp(prefix="mcpd-c-", dir="/tmp"), fast_above_ms)
    core = scheduler_of(config, Ports(), Clock())
    hello(core, 0, "a")
    hello(core, 1, "b")
    for rid in range(1, 17):
        core.on_inbox(*decoded(request(rid, GenerateArgs(prompt="x"))))
    core.clock.now += 0.020
    core.tick()   # the window adjusts on the 16th dispatch, and the rung follows it at once
    return core


def test_a_reload_that_lowers_a_classs_fast_target_below_its_p99_puts_it_on_the_rung_at_once():
    core = class_waited_20_ms(fast_above_ms=0.0)   # no target: never fast
    core.apply_config(fast_model_config(str(core.config.server.runtime_dir), fast_above_ms=5.0))
    core.on_inbox(*decoded(request(17, GenerateArgs(prompt="x", hints={"prefer_speed": True}))))
    assert core.jobs[17].served == ("m", "b")


def test_requests_that_prefer_speed_go_fast_while_their_class_waits_too_long():
    core = class_waited_20_ms(fast_above_ms=5.0)
    core.on_inbox(*decoded(request(17, GenerateArgs(prompt="x", hints={"prefer_speed": True}))))
    core.on_inbox(*decoded(request(18, GenerateArgs(prompt="x"))))
    assert core.jobs[17].served == ("m", "b") and core.jobs[18].served == ("m", "a")
    assert core.stats()["fast_rung"] == FastRungState(["normal"], 1)


def test_a_reload_applies_a_models_policy_live_but_not_a_change_of_its_versions(core):
    base = {"server": {"runtime_dir": core.config.server.runtime_dir}, "cache": {"enabled": False},
            "persistence": {"enabled": False}, "scheduler": {"max_inflight_per_worker": 1}}
    promoted = from_dict({**base, "models": {"m": {"default": "b", "versions": {"a": {}, "b": {}}}}})
    assert core.apply_config(promoted) == ["models.m"]
    assert core.traffic.route(None, None, "k") == ("m", "b")
    grown = from_dict({**base, "models": {"m": {"default": "a", "versions": {"a": {}, "b": {}, "c": {}}}}})
    assert core.apply_config(grown) == []   # a new version needs its workers: a restart
    assert core.traffic.route(None, None, "k") == ("m", "b")
