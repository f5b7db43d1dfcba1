"""The supervisor's core in-process: children's events, mcpctl's requests and a clock in; child
starts, messages, replies and systemd's notes out through fake ports. What crosses processes (a
killed child, a real fork server, mcpctl over its socket) stays with the daemon tests."""
import logging
import os
import signal

import msgpack

from mcpd import refusal
from mcpd.config import Config, WorkersConfig
from mcpd.daemon import child as children, messages
from mcpd.daemon.child_stats import WorkerStats
from mcpd.daemon.supervisor.admin import FORWARD_TIMEOUT_S
from mcpd.daemon.supervisor.core import REFUSAL_REPORT_WAIT_S, SupervisorCore
from mcpd.daemon.supervisor.process_table import STABLE_AFTER_S
from mcpd.protocol import codes, wire
from mcpd.protocol.control_ops import ANSWERED_WHILE_STOPPING
from mcpd.protocol.control_results import ContextList, ContextSummary, VersionState
from mcpd.protocol.error import ErrorReply
from mcpd.security.keys import KeyStore
from mcpd.security.peer import PeerCred
from fakes import Clock, SupervisorPorts, decoded

CONFIG = Config(workers=WorkersConfig(restart_backoff_s=1.0, restart_backoff_max_s=4.0))
OPERATOR = PeerCred(uid=os.getuid(), gid=os.getgid(), pid=1)


def make_core(watchdog_interval_s: float | None = None) -> SupervisorCore:
    core = SupervisorCore(CONFIG, None, ["cpu"], logging.getLogger("test"), SupervisorPorts(),
                          KeyStore(CONFIG.keys_dir), Clock(), watchdog_interval_s=watchdog_interval_s)
    core.start()
    return core


def child(core: SupervisorCore, role: str):
    return core.table.find(role, 0)


def event(core: SupervisorCore, kind, role: str, *fields, pid: int | None = None) -> None:
    """An event as child.EventReporter sends it, from the child's running process unless `pid` says."""
    sender = messages.Sender(role, 0, child(core, role).process.pid if pid is None else pid)
    core.on_event(decoded(messages.encode(kind(sender, *fields)))[0])


def ready_all(core: SupervisorCore) -> None:
    for role in ("frontend", "scheduler", "keeper", "worker"):
        event(core, messages.Ready, role)
    core.tick()


def call(core: SupervisorCore, op: str, request_id, identity: bytes = b"A", args: dict | None = None) -> None:
    core.on_control([identity, wire.encode_request(op, request_id, args)], OPERATOR)


def replies(core: SupervisorCore) -> list[tuple[bytes, dict]]:
    return [(frames[0], msgpack.unpackb(frames[-1])) for frames in core.ports.control]


def sent(destination) -> list[messages.Message]:
    return [message for message, _ in destination]


def status(core: SupervisorCore) -> dict:
    call(core, "status", "s")
    identity, reply = replies(core)[-1]
    return reply["result"]


def crash(core: SupervisorCore, role: str) -> float:
    """The child exits with status 1; returns the backoff the core gave its restart."""
    child(core, role).process.exit(1)
    core.tick()
    return child(core, role).restart_at - core.clock.now


def test_a_crashed_child_is_started_again_after_its_backoff():
    core = make_core()
    ready_all(core)
    worker = child(core, "worker")
    first = worker.process
    first.exit(1)
    core.tick()
    assert sent(core.ports.scheduler) == [messages.WorkerLost(0, first.pid)]   # its requests are retried or answered
    assert worker.state == "restarting" and worker.last_exit == "exited with status 1"
    core.clock.now += 0.9
    core.tick()
    assert worker.process is first
    core.clock.now += 0.1
    core.tick()
    assert worker.process is not first and worker.process.is_alive() and worker.restarts == 1
    assert worker.state == "starting"


def test_a_restart_asked_for_a_worker_dead_since_the_last_turn_starts_it_at_the_next():
    """The worker died (a SIGKILL) and the op came before the supervisor's loop reaped it: the op
    reaps it and the next turn starts it, without its backoff, rather than refuse it as stopped.
    (test_mcpctl.py sends it to a real daemon, where this order is a race.)"""
    core = make_core()
    ready_all(core)
    worker = child(core, "worker")
    first = worker.process
    first.kill()   # no turn since
    call(core, "workers.restart", 1, args={"index": 0})
    [(_, reply)] = replies(core)
    assert reply["kind"] == "ok" and reply["result"]["old_pid"] is None, reply
    assert sent(core.ports.scheduler) == [messages.WorkerLost(0, first.pid)]
    core.tick()
    assert worker.process is not first and worker.process.is_alive()


def test_the_backoff_doubles_up_to_its_cap_and_resets_after_a_stable_run():
    core = make_core()
    ready_all(core)
    backoffs = []
    for _ in range(4):
        backoffs.append(crash(core, "scheduler"))
        core.clock.now += backoffs[-1]
        core.tick()
    assert backoffs == [1.0, 2.0, 4.0, 4.0]
    assert sent(core.ports.frontend) == [messages.SchedulerLost()] * 4
    core.clock.now += STABLE_AFTER_S
    assert crash(core, "scheduler") == 1.0


def test_a_crash_loop_keeps_the_watchdog_hungry_and_shows_in_the_status():
    core = make_core(watchdog_interval_s=1.0)
    ready_all(core)
    assert core.ports.notified.count({"WATCHDOG": 1}) == 1
    for _ in range(3):
        core.clock.now += crash(core, "worker")
        core.tick()   # started again, never ready
    core.clock.now += 5.0
    core.tick()
    assert core.ports.notified.count({"WATCHDOG": 1}) == 1   # systemd restarts a daemon that stays so
    report = status(core)
    worker = next(p for p in report["processes"] if p["role"] == "worker")
    assert report["state"] == "degraded" and not report["healthy"]
    assert (worker["state"], worker["restarts"], worker["last_exit"]) == ("starting", 3, "exited with status 1")


def test_a_child_that_refuses_to_start_stops_the_daemon_with_its_reason():
    core = make_core()
    started = len(core.ports.started)
    event(core, messages.Refused, "frontend", "tcp port 5555 is taken", refusal.IN_USE)
    child(core, "frontend").process.exit(children.EXIT_REFUSED)
    core.tick()
    assert core.stopping and isinstance(core.refusal, refusal.InUse)
    assert str(core.refusal) == "frontend cannot start: tcp port 5555 is taken"
    assert core.ports.notified[-1] == {"STATUS": str(core.refusal)}
    core.tick()
    assert len(core.ports.started) == started   # never restarted


def test_a_refusal_whose_reason_never_comes_stops_the_daemon_after_a_wait():
    core = make_core()
    child(core, "worker").process.exit(children.EXIT_REFUSED)
    core.tick()
    assert not core.stopping   # its reason may be on its way
    core.clock.now += REFUSAL_REPORT_WAIT_S
    core.tick()
    assert core.stopping and "worker 0 cannot start: no reason reported" in str(core.refusal)


def test_the_daemon_is_ready_once_every_child_is():
    core = make_core()
    for role in ("frontend", "scheduler", "keeper"):
        event(core, messages.Ready, role)
    event(core, messages.Ready, "worker", pid=child(core, "worker").process.pid + 1)   # an incarnation that is gone
    core.tick()
    assert not any("READY" in note for note in core.ports.notified)
    assert status(core)["state"] == "starting"
    event(core, messages.Ready, "worker")
    core.tick()
    core.tick()
    assert [note for note in core.ports.notified if "READY" in note] == [{"READY": 1, "STATUS": "serving with 1 worker(s)"}]
    assert status(core)["state"] == "ready"


def test_drain_reaches_the_frontend_and_its_drained_ends_the_stop():
    core = make_core()
    ready_all(core)
    call(core, "drain", 7)
    assert sent(core.ports.frontend) == [messages.Drain()]
    assert replies(core)[-1] == (b"A", {"v": wire.VERSION, "id": 7, "kind": "ok", "result": {"draining": True}})
    deadline = core.begin_stop()
    assert sent(core.ports.frontend) == [messages.Drain()] * 2 and core.still_draining(deadline)
    event(core, messages.Drained, "frontend", pid=child(core, "frontend").process.pid + 1)
    assert core.still_draining(deadline)   # not from the front-end that runs
    event(core, messages.Drained, "frontend")
    assert not core.still_draining(deadline)


def test_while_stopping_the_supervisor_answers_what_reads_and_refuses_what_changes():
    core = make_core()
    ready_all(core)
    call(core, "contexts.list", "early")   # forwarded before the stop; the scheduler never answers
    core.begin_stop()
    for request_id, op, args in (("reload", "reload", None), ("restart", "workers.restart", {"index": 0}),
                                 ("list", "contexts.list", None), ("drain", "drain", None)):
        call(core, op, request_id, args=args)
    for op in sorted(ANSWERED_WHILE_STOPPING):
        call(core, op, op)
    assert [m.op for m in sent(core.ports.scheduler)] == ["contexts.list"]   # the early one only
    core.admin.abandon()
    answered = {reply["id"]: reply for _, reply in replies(core)}
    assert sorted(answered) == sorted(["reload", "restart", "list", "drain", "early", *ANSWERED_WHILE_STOPPING])
    assert {i for i, reply in answered.items() if reply["kind"] == "error"} == {"reload", "restart", "list", "drain", "early"}
    assert {answered[i]["code"] for i in ("reload", "restart", "list", "drain", "early")} == {codes.UNAVAILABLE}
    assert answered["status"]["result"]["state"] == "stopping"
    assert child(core, "worker").alive   # workers.restart did nothing


def test_a_drain_that_outlasts_the_grace_period_ends_the_stop():
    core = make_core()
    ready_all(core)
    deadline = core.begin_stop()
    core.clock.now += CONFIG.supervisor.stop_grace_s - 0.1
    assert core.still_draining(deadline)
    core.clock.now += 0.1
    assert not core.still_draining(deadline)


def test_a_forwarded_ops_answer_reaches_the_caller_that_asked():
    core = make_core()
    ready_all(core)
    call(core, "contexts.list", 1, identity=b"A")
    call(core, "contexts.list", "b", identity=b"B", args={"limit": 5})
    asked = sent(core.ports.scheduler)
    assert [(m.op, m.args.limit) for m in asked] == [("contexts.list", 1000), ("contexts.list", 5)]
    assert core.ports.control == []   # both wait for the scheduler
    listed = ContextList(1, [ContextSummary("t", "x", 2, 5, ["f"], 64, False, None)])
    event(core, messages.AdminAnswer, "scheduler", asked[1].token, listed)
    event(core, messages.AdminAnswer, "scheduler", asked[0].token, None,
          ErrorReply(codes.NOT_FOUND, "no such owner"))
    assert [(identity, reply["id"], reply.get("result"), reply.get("code")) for identity, reply in replies(core)] == [
        (b"B", "b", {"total": 1, "contexts": [{"owner": "t", "id": "x", "version": 2, "tokens": 5, "fields": ["f"],
                                              "bytes": 64, "busy": False, "kv_version": None}]}, None),
        (b"A", 1, None, codes.NOT_FOUND)]   # mcpctl gets the result's map, without the message's tag


def test_a_forwarded_op_the_scheduler_never_answers_times_out():
    core = make_core()
    ready_all(core)
    call(core, "contexts.list", 3, identity=b"C")
    core.clock.now += FORWARD_TIMEOUT_S - 0.1
    core.tick()
    assert core.ports.control == []
    core.clock.now += 0.1
    core.tick()
    identity, reply = replies(core)[0]
    assert (identity, reply["id"], reply["code"]) == (b"C", 3, codes.UNAVAILABLE)
    event(core, messages.AdminAnswer, "scheduler", sent(core.ports.scheduler)[0].token, ContextList(0, []))
    assert len(core.ports.control) == 1   # a late answer is not a second reply


def test_the_status_shows_each_childs_latest_stats_from_its_running_process():
    core = make_core()
    ready_all(core)
    event(core, messages.Report, "worker", WorkerStats(device="cpu", running=2))
    event(core, messages.Report, "worker", WorkerStats(device="cpu", running=9), pid=1)   # not its process
    report = status(core)
    assert [(d["worker"], d["device"], d["running"]) for d in report["devices"]] == [(0, "cpu", 2)]
    worker = next(p for p in report["processes"] if p["role"] == "worker")
    assert (worker["pid"], worker["stats_reports"]) == (child(core, "worker").process.pid, 1)
    assert report["pools"][0]["device"] == "cpu"


def test_an_unauthorized_caller_is_refused_a_privileged_op():
    core = make_core()
    stranger = PeerCred(uid=os.getuid() + 1, gid=os.getgid() + 1, pid=2)
    core.on_control([b"Z", wire.encode_request("drain", 4)], stranger)
    [(identity, reply)] = replies(core)
    assert (identity, reply["id"], reply["code"]) == (b"Z", 4, codes.UNAUTHORIZED)
    assert core.ports.frontend == []


def test_a_dead_pool_keeper_takes_its_devices_workers_with_it():
    core = make_core()
    ready_all(core)
    worker = child(core, "worker").process
    child(core, "keeper").process.exit(1)
    core.tick()
    assert worker.exitcode == -signal.SIGKILL   # none may map a pool nobody keeps
    core.tick()
    assert sent(core.ports.scheduler) == [messages.WorkerLost(0, worker.pid)]


def test_a_reload_answers_its_caller_once_every_running_child_confirmed():
    core = make_core()
    ready_all(core)
    call(core, "reload", 5, identity=b"R")
    reload = sent(core.ports.scheduler)[-1]
    assert isinstance(reload, messages.Reload) and sent(core.ports.frontend)[-1] == reload
    for role in ("frontend", "scheduler"):
        event(core, messages.Reloaded, role, reload.token, [])
    assert core.ports.control == []   # worker 0 has not confirmed yet
    event(core, messages.Reloaded, "worker", reload.token, [])
    [(identity, reply)] = replies(core)
    assert (identity, reply["id"], reply["result"]["confirmed"]) == (b"R", 5, ["frontend 0", "scheduler 0", "worker 0"])
    assert "workers.restart_backoff_s" in reply["result"]["applied"]   # the file (the defaults) says 0.5, live
    assert core.config.workers.restart_backoff_s == 0.5


def test_an_unloaded_versions_workers_stop_for_good_and_give_their_pool_regions_back():
    core = make_core()
    ready_all(core)
    worker = child(core, "worker")
    process = worker.process
    call(core, "models.unload", 6, args={"model": worker.spec.model, "version": worker.spec.version})
    asked = sent(core.ports.scheduler)[-1]
    assert process.is_alive()   # the scheduler finishes the version's requests first
    unloaded = VersionState(worker.spec.model, worker.spec.version, loaded=False)
    event(core, messages.AdminAnswer, "scheduler", asked.token, unloaded)
    [(identity, reply)] = replies(core)
    assert reply["result"] == {"model": worker.spec.model, "version": worker.spec.version, "loaded": False,
                               "workers": [0], "pool_regions_freed": 0}
    assert process.exitcode == -signal.SIGTERM and core.ports.reclaimed == [("cpu", 0)]
    assert sent(core.ports.scheduler)[-1] == messages.WorkerLost(0, process.pid)
    core.clock.now += 60
    core.tick()
    assert worker.process is process and worker.state == "unloaded"   # not restarted
