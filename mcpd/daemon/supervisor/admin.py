"""The supervisor's answers to mcpctl: every control op, including those it forwards to the
scheduler (context ops) and to all children (reload) and answers once they report back. Which
op exists, its arguments and its handler (a method here by name) come from the control-op table,
protocol/control_ops.py.

Forwarded ops wait as `Pending` entries keyed by a token; the reply goes out when the last
expected event arrives, or when the op's time runs out (with what arrived so far), so an op
never hangs the control socket and a dead child never hangs an op.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import platform
from dataclasses import dataclass, field
from typing import Callable

import mcpd
from mcpd.cluster.redis_url import redacted
from mcpd.config import Config, ConfigError
from mcpd.daemon import live_config, messages
from mcpd.daemon.supervisor.status import build_status
from mcpd.memory.pool_segment import PoolBusy
from mcpd.protocol import codes, control_ops, wire
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.control_args import ControlArgs, ModelVersion, NoArgs
from mcpd.protocol.control_results import VersionState, as_map
from mcpd.protocol.error import ErrorReply
from mcpd.security import key_ops

FORWARD_TIMEOUT_S = 30.0   # the most a forwarded op waits, and a reload when the caller names no timeout
# What the supervisor applies itself on reload: the children read these from it, not their copy.
SUPERVISOR_LIVE = ("supervisor.stop_grace_s", "supervisor.ready_timeout_s",
                   "workers.restart_backoff_s", "workers.restart_backoff_max_s")


@dataclass
class Pending:
    reply_to: tuple | None        # (identity, envelope, request_id); None for SIGHUP's reload
    deadline: float
    waiting_for: set = field(default_factory=set)   # (role, index) still to confirm a reload
    summary: dict = field(default_factory=dict)     # a reload's report so far
    fresh: Config | None = None                     # a reload's newly read config
    after: Callable[[ModelVersion, VersionState], dict] | None = None   # a forwarded op's own step, once agreed
    args: ControlArgs = NoArgs()                    # the forwarded op's


@dataclass(frozen=True)
class ControlCall:
    """One control request, its op found and its args decoded into the op's struct."""
    op: control_ops.ControlOp
    args: ControlArgs
    reply_to: tuple   # (identity, envelope, request_id)


class Admin:
    def __init__(self, supervisor):
        self.supervisor = supervisor
        self.tokens = itertools.count(1)
        self.pending: dict[int, Pending] = {}

    # -- requests from mcpctl -------------------------------------------------------------------

    def handle(self, identity: bytes, request: wire.Request) -> dict | None:
        """The op's result now, or None when the answer comes later (sent by `answer`). The op
        and its handler come from the control-op table (protocol/control_ops.py)."""
        op = control_ops.find(request.op)
        if self.supervisor.stopping and op.name not in control_ops.ANSWERED_WHILE_STOPPING:
            raise MCPDError(codes.UNAVAILABLE, f"mcpd is stopping; it answers only "
                                               f"{', '.join(sorted(control_ops.ANSWERED_WHILE_STOPPING))}")
        call = ControlCall(op, op.decode_args(request.header["args"]),
                           (identity, request.envelope, request.request_id))
        if op.runs_in is control_ops.Place.SCHEDULER:
            return self._forward(call)
        return getattr(self, op.handler)(call)

    def ping(self, _call) -> dict:
        return {"pong": True, "pid": os.getpid()}

    def status(self, _call) -> dict:
        return build_status(self.supervisor)

    def version(self, _call) -> dict:
        return {"version": mcpd.__version__, "protocol": wire.VERSION, "python": platform.python_version()}

    def config(self, _call) -> dict:
        """The effective configuration, the Redis URL's password masked as in the log."""
        config = self.supervisor.config.to_dict()
        config["cluster"]["redis"] = redacted(config["cluster"]["redis"])
        return {"path": self.supervisor.config_path, "config": config}

    def workers(self, _call) -> dict:
        status = build_status(self.supervisor)
        devices = {d["worker"]: d for d in status["devices"]}
        return {"workers": [{**p, **devices.get(p["index"], {})} for p in status["processes"] if p["role"] == "worker"]}

    def restart_worker(self, call: ControlCall) -> dict:
        """SIGTERM the worker; the supervisor restarts it as after any exit, and the scheduler
        requeues its requests that had not started streaming (the rest get WORKER_LOST). A worker
        waiting out its restart backoff is started now (old_pid None): the operator who fixed
        what made it fail need not wait up to restart_backoff_max_s for it. So is one that died since
        the supervisor's last turn."""
        index = call.args.index
        child = self.supervisor.table.find("worker", index)
        if child is None:
            raise MCPDError(codes.NOT_FOUND, f"no worker {index!r}")
        self.supervisor.reap_children()   # one that died since the loop's last turn: restart it now
        if child.restart_at is not None:
            child.restart_at = self.supervisor.clock()   # the supervisor's next turn starts it
            return {"index": child.spec.index, "old_pid": None, "restarts": child.restarts}
        if not child.alive:
            raise MCPDError(codes.CONFLICT, f"worker {child.spec.index} is not running ({child.state})")
        pid = child.process.pid
        child.process.terminate()   # if it died this instant, the loop reaps it and starts it again all the same
        return {"index": child.spec.index, "old_pid": pid, "restarts": child.restarts}

    def drain(self, _call) -> dict:
        self.supervisor.ports.to_frontend(messages.Drain())
        return {"draining": True}

    def resume(self, _call) -> dict:
        self.supervisor.drained = False
        self.supervisor.ports.to_frontend(messages.Resume())
        return {"draining": False}

    def keys_list(self, _call) -> dict:
        return key_ops.list_keys(self.supervisor.keys, self.supervisor.config.curve)

    def keys_api_add(self, call: ControlCall) -> dict:
        return key_ops.api_add(self.supervisor.keys, call.args.name)

    def keys_api_revoke(self, call: ControlCall) -> dict:
        return key_ops.api_revoke(self.supervisor.keys, call.args.name)

    def keys_allow(self, call: ControlCall) -> dict:
        return key_ops.allow(self.supervisor.keys, call.args.name, call.args.public_key)

    def keys_revoke(self, call: ControlCall) -> dict:
        return key_ops.revoke(self.supervisor.keys, call.args.name)

    # -- forwarded ops --------------------------------------------------------------------------

    def _forward(self, call: ControlCall) -> None:
        token = next(self.tokens)
        after = {"models.load": self._start_version, "models.unload": self._stop_version}.get(call.op.name)
        self.pending[token] = Pending(call.reply_to, self.supervisor.clock() + FORWARD_TIMEOUT_S, after=after, args=call.args)
        self.supervisor.ports.to_scheduler(messages.Admin(token, call.op.name, call.args))

    def reload(self, call: ControlCall) -> dict | None:
        return self.reload_config(call.reply_to, call.args.timeout_s)

    def reload_config(self, reply_to: tuple | None, timeout_s: float | None = None) -> dict | None:
        """Re-read the config file, apply what can change live and say what needs a restart.

        The reply waits up to `timeout_s` for every child to confirm (0: answer at once with
        what the supervisor applied itself; the children's part then shows in the log)."""
        timeout_s = FORWARD_TIMEOUT_S if timeout_s is None else timeout_s
        supervisor = self.supervisor
        try:
            fresh = supervisor.ports.read_config()
        except ConfigError as e:
            supervisor.log.error("reload: keeping the running configuration: %s", e)
            raise MCPDError(codes.BAD_REQUEST, f"config not reloaded: {e}") from None
        changed = changed_keys(supervisor.config.to_dict(), fresh.to_dict())
        applied = [k for k in changed if k in SUPERVISOR_LIVE + live_config.EVERY_PROCESS]
        live_config.apply_log_level(fresh)
        self._adopt(fresh, applied)
        token = next(self.tokens)
        message = messages.Reload(token, fresh)
        supervisor.ports.to_scheduler(message)
        supervisor.ports.to_frontend(message)
        # A pool keeper runs no configurable part: it is not sent the reload.
        waiting = {(c.spec.role, c.spec.index) for c in supervisor.table.children
                   if c.alive and c.ready and c.spec.role != "keeper"}
        summary = {"path": supervisor.config_path, "changed": changed, "applied": applied, "confirmed": []}
        self.pending[token] = Pending(reply_to, supervisor.clock() + timeout_s, waiting, summary, fresh)
        if timeout_s == 0 or not waiting:
            return self._finish(token)
        return None

    def _adopt(self, fresh: Config, keys: list[str]) -> None:
        """Make `keys` of `fresh` part of the effective config: the supervisor's own, and the one
        a restarted child will get (only what every process runs with, so they never disagree)."""
        if not keys:
            return
        supervisor = self.supervisor
        supervisor.config = with_keys(supervisor.config, fresh, keys)
        supervisor.table.config = supervisor.config
        for child in supervisor.table.children:
            child.spec.config = supervisor.config
        supervisor.table.drop_standbys()   # they hold the old config; new ones come with the new

    # -- model versions: the scheduler routes, the supervisor starts and stops their workers ------

    def _version_workers(self, args: ModelVersion) -> list:
        return [c for c in self.supervisor.table.children if c.spec.role == "worker"
                and (c.spec.model, c.spec.version) == (args.model, args.version)]

    def _start_version(self, args: ModelVersion, result: VersionState) -> dict:
        """models.load, once the scheduler routes to the version: start its workers (requests
        for it wait in its lane until they say hello)."""
        workers = self._version_workers(args)
        for child in workers:
            self.supervisor.table.unpark(child)
        return {**as_map(result), "workers": [c.spec.index for c in workers]}

    def _stop_version(self, args: ModelVersion, result: VersionState) -> dict:
        """models.unload, once the scheduler has finished the version's last request and its last
        reply reached the front-end (scheduler/unload.py): stop its workers, tell the scheduler
        they are gone, and give their regions (weights, KV) back to the device pool, where they
        coalesce with their free neighbours; a later load of the version loads its weights again."""
        workers = self._version_workers(args)
        freed = 0
        for child in workers:
            pid = self.supervisor.table.park(child)
            if pid is not None:
                self.supervisor.ports.to_scheduler(messages.WorkerLost(child.spec.index, pid))
            freed += self._reclaim(child)
        return {**as_map(result), "workers": [c.spec.index for c in workers], "pool_regions_freed": freed}

    def _reclaim(self, child) -> int:
        """A parked worker's pool regions back to its device's pool (0 on a private pool)."""
        try:
            return self.supervisor.ports.reclaim_pool(self.supervisor.config, child.spec.device, child.spec.index)
        except PoolBusy as e:   # it outlived park's SIGKILL: its regions stay, never handed on while it lives
            self.supervisor.log.warning("%s: pool regions kept: %s", child.spec.name, e)
            return 0

    # -- events from children -------------------------------------------------------------------

    def on_event(self, event: messages.AdminAnswer | messages.Reloaded) -> None:
        pending = self.pending.get(event.token)
        if pending is None:
            return   # answered already (timed out)
        if isinstance(event, messages.AdminAnswer):
            self.pending.pop(event.token)
            return self._relay(pending, event)
        sender = event.sender
        pending.waiting_for.discard((sender.role, sender.index))
        pending.summary["confirmed"].append(f"{sender.role} {sender.index}")
        new_keys = [k for k in event.applied if k in pending.summary["changed"] and k not in pending.summary["applied"]]
        pending.summary["applied"] += new_keys
        self._adopt(pending.fresh, new_keys)
        if not pending.waiting_for:
            self._finish(event.token)

    def _relay(self, pending: Pending, event: messages.AdminAnswer) -> None:
        """The scheduler's answer to its caller: the error, or the result's map (and the op's own step's keys)."""
        if event.error is not None:
            self.answer(pending.reply_to, None, event.error)
        elif pending.after is not None:
            self.answer(pending.reply_to, pending.after(pending.args, event.result))
        else:
            self.answer(pending.reply_to, as_map(event.result))

    def expire(self) -> None:
        """Answer ops whose time ran out: forwarded ones with UNAVAILABLE, reloads with what came."""
        now = self.supervisor.clock()
        for token, pending in list(self.pending.items()):
            if now < pending.deadline:
                continue
            if pending.summary:
                self._finish(token)
            else:
                del self.pending[token]
                self.answer(pending.reply_to, None, ErrorReply(codes.UNAVAILABLE, "the scheduler did not answer in time"))

    def abandon(self) -> None:
        """Every op still waiting answered UNAVAILABLE: the daemon stops, and its children with it."""
        for token, pending in list(self.pending.items()):
            del self.pending[token]
            if pending.reply_to is not None:
                self.answer(pending.reply_to, None, ErrorReply(codes.UNAVAILABLE, "mcpd stopped before it was done"))

    def _finish(self, token: int) -> dict:
        pending = self.pending.pop(token)
        summary = pending.summary
        summary["needs_restart"] = [k for k in summary["changed"] if k not in summary["applied"]]
        summary["unconfirmed"] = sorted(f"{role} {index}" for role, index in pending.waiting_for)
        log = self.supervisor.log
        log.info("reload: %s", "; ".join(f"{k}: {', '.join(v) or '-'}" for k, v in summary.items()
                                          if k in ("applied", "needs_restart", "unconfirmed")))
        if pending.reply_to is not None:
            self.answer(pending.reply_to, summary)
        return summary

    def answer(self, reply_to: tuple, result: dict | None, error: ErrorReply | None = None) -> None:
        identity, envelope, request_id = reply_to
        reply = wire.ok_reply(request_id, result) if error is None else wire.error_reply(request_id, error)
        self.supervisor.ports.to_control([identity, *envelope, reply])


def changed_keys(old: dict, new: dict) -> list[str]:
    """"section.key" names of the keys whose values differ between two Config.to_dict() trees.
    A key's value is compared whole, tables included (scheduler.classes): a live reload applies a
    key at a time, and a class added or removed is a change of that key, not a missing one."""
    return [f"{section}.{key}" for section in old for key in old[section].keys() | new[section].keys()
            if old[section].get(key) != new[section].get(key)]


def with_keys(old: Config, new: Config, keys: list[str]) -> Config:
    """`old` with the dotted `keys` taken from `new`."""
    sections = {}
    for key in keys:
        section, name = key.split(".", 1)
        table = getattr(new, section)   # a table of named entries ([models]) or a section's dataclass
        sections.setdefault(section, {})[name] = table[name] if isinstance(table, dict) else getattr(table, name)
    return dataclasses.replace(old, **{s: {**getattr(old, s), **v} if isinstance(getattr(old, s), dict)
                                       else dataclasses.replace(getattr(old, s), **v) for s, v in sections.items()})
