"""Every op of the control socket (control.ipc, docs/PROTOCOL.md section 9), in one table.

Each op says what it takes, who may call it, where it runs and what answers it; `mcpctl`, the
supervisor's dispatch (daemon/supervisor/admin.py), the scheduler's (daemon/scheduler/admin.py),
the authorization check (security/peer.py) and PROTOCOL.md section 9 all follow this table, and
tests hold them to it (tests/test_control_ops.py). Adding an op is one entry here, its args
struct (unless it takes none), its result struct if it runs in the scheduler (control_results.py),
its handler, its `mcpctl` command and its row in the doc.

`arg_struct` declares the op's args (control_args.py): the supervisor decodes them into it once.
`handler` names the function that answers the op: for an op that runs in the scheduler, a
function of mcpd.daemon.scheduler.admin, called with (scheduler, args struct, token); for every
other op, a method of mcpd.daemon.supervisor.admin.Admin, called with a ControlCall (the
supervisor answers it, itself or after relaying it to the front-end or to every process). Names rather than functions keep this module
free of the daemon, so that `mcpctl` can read the table without loading it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from mcpd.protocol import codes, control_args
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.control_args import (ContextListing, ContextRef, ControlArgs, KeyGrant, KeyName, ModelRef,
                                        ModelVersion, NoArgs, ReloadTimeout, ShadowPlan, TrafficSplit, WorkerIndex)


class Access(enum.Enum):
    ANYONE = "anyone"          # whoever can connect to control.ipc
    PRIVILEGED = "privileged"  # the daemon's user, root, or security.admin_group (security/peer.py)


class Place(enum.Enum):
    SUPERVISOR = "supervisor"
    SCHEDULER = "scheduler"            # forwarded on sched.ipc; the answer comes back as an event
    FRONTEND = "front-end"             # relayed on frontend.ipc; the supervisor answers at once
    EVERY_PROCESS = "every process"    # relayed to all; the answer waits for their confirmations


@dataclass(frozen=True)
class ControlOp:
    name: str
    summary: str
    access: Access
    runs_in: Place
    handler: str
    arg_struct: type[ControlArgs] = NoArgs

    def decode_args(self, args: dict) -> ControlArgs:
        """The op's args struct, or BAD_REQUEST naming the argument."""
        return control_args.decode(self.name, args, self.arg_struct)


OPS = {op.name: op for op in (
    ControlOp("ping", "is the supervisor there", Access.ANYONE, Place.SUPERVISOR, "ping"),
    ControlOp("status", "processes, devices, queues, caches, latency", Access.ANYONE, Place.SUPERVISOR, "status"),
    ControlOp("version", "the daemon's versions", Access.PRIVILEGED, Place.SUPERVISOR, "version"),
    ControlOp("config", "the effective configuration", Access.PRIVILEGED, Place.SUPERVISOR, "config"),
    ControlOp("workers", "every worker and its device", Access.PRIVILEGED, Place.SUPERVISOR, "workers"),
    ControlOp("workers.restart", "restart one worker", Access.PRIVILEGED, Place.SUPERVISOR, "restart_worker",
              WorkerIndex),
    ControlOp("drain", "stop admitting new work", Access.PRIVILEGED, Place.FRONTEND, "drain"),
    ControlOp("resume", "admit new work again", Access.PRIVILEGED, Place.FRONTEND, "resume"),
    ControlOp("reload", "re-read the config file and apply what can change live", Access.PRIVILEGED,
              Place.EVERY_PROCESS, "reload", ReloadTimeout),
    ControlOp("contexts.list", "contexts of every tenant, or of one", Access.PRIVILEGED, Place.SCHEDULER,
              "list_contexts", ContextListing),
    ControlOp("contexts.show", "one context's version, fields and sizes", Access.PRIVILEGED, Place.SCHEDULER,
              "show_context", ContextRef),
    ControlOp("contexts.drop", "delete one context and its journal entries", Access.PRIVILEGED, Place.SCHEDULER,
              "drop_context", ContextRef),
    ControlOp("models.promote", "send every new request of a model to one version", Access.PRIVILEGED,
              Place.SCHEDULER, "promote_version", ModelVersion),
    ControlOp("models.split", "spread a model's new requests over versions by weight", Access.PRIVILEGED,
              Place.SCHEDULER, "split_versions", TrafficSplit),
    ControlOp("models.rollback", "back to a model's policy before its last promote or split", Access.PRIVILEGED,
              Place.SCHEDULER, "roll_back_version", ModelRef),
    ControlOp("models.shadow", "run a share of a model's requests on a candidate version too, and compare",
              Access.PRIVILEGED, Place.SCHEDULER, "shadow_version", ShadowPlan),
    ControlOp("models.load", "start a version's workers; it takes requests", Access.PRIVILEGED, Place.SCHEDULER,
              "load_version", ModelVersion),
    ControlOp("models.unload", "stop a version's workers once its requests are done", Access.PRIVILEGED,
              Place.SCHEDULER, "unload_version", ModelVersion),
    ControlOp("keys.list", "the server's public key and the allowed client keys", Access.PRIVILEGED,
              Place.SUPERVISOR, "keys_list"),
    ControlOp("keys.allow", "let the holder of a public key connect as a tenant", Access.PRIVILEGED,
              Place.SUPERVISOR, "keys_allow", KeyGrant),
    ControlOp("keys.revoke", "refuse a client key from now on", Access.PRIVILEGED, Place.SUPERVISOR,
              "keys_revoke", KeyName),
    ControlOp("keys.api.add", "a new HTTP API key for a tenant (shown once, stored hashed)", Access.PRIVILEGED,
              Place.SUPERVISOR, "keys_api_add", KeyName),
    ControlOp("keys.api.revoke", "refuse a tenant's HTTP API key from now on", Access.PRIVILEGED,
              Place.SUPERVISOR, "keys_api_revoke", KeyName),
)}


# What the supervisor still answers while it stops (a SIGTERM's drain): it reads, changes nothing.
ANSWERED_WHILE_STOPPING = frozenset({"ping", "status", "version", "config", "workers"})


def find(name: str) -> ControlOp:
    """The op called `name`; UNKNOWN_OP naming the known ones otherwise."""
    op = OPS.get(name)
    if op is None:
        raise MCPDError(codes.UNKNOWN_OP, f"unknown control op {name!r}; known: {', '.join(sorted(OPS))}")
    return op


def open_to_anyone(name: str) -> bool:
    """Whether `name` needs no privilege; an unknown op does (so a new op is privileged until
    its entry says otherwise)."""
    return name in OPS and OPS[name].access is Access.ANYONE

