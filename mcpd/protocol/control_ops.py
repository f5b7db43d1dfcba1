"""Every op of the control socket (control.ipc, docs/PROTOCOL.md section 9), in one table.

Each op says what it takes, who may call it, where it runs and what answers it; `mcpctl`, the
supervisor's dispatch (daemon/supervisor/admin.py), the scheduler's (daemon/scheduler/admin.py),
the authorization check (security/peer.py) and PROTOCOL.md section 9 all follow this table, and
tests hold them to it (tests/test_control_ops.py). Adding an op is one entry here, its handler,
its `mcpctl` command and its row in the doc.

`handler` names the function that answers the op: for an op that runs in the scheduler, a
function of mcpd.daemon.scheduler.admin, called with (store, args); for every other op, a
method of mcpd.daemon.supervisor.admin.Admin, called with a ControlCall (the supervisor answers
it, itself or after relaying it to the front-end or to every process). Names rather than functions keep this module
free of the daemon, so that `mcpctl` can read the table without loading it.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.tenant import DEFAULT_TENANT


class Access(enum.Enum):
    ANYONE = "anyone"          # whoever can connect to control.ipc
    PRIVILEGED = "privileged"  # the daemon's user, root, or security.admin_group (security/peer.py)


class Place(enum.Enum):
    SUPERVISOR = "supervisor"
    SCHEDULER = "scheduler"            # forwarded on sched.ipc; the answer comes back as an event
    FRONTEND = "front-end"             # relayed on frontend.ipc; the supervisor answers at once
    EVERY_PROCESS = "every process"    # relayed to all; the answer waits for their confirmations


@dataclass(frozen=True)
class Arg:
    """One argument: its msgpack type, whether it must be given, its default, and its bounds (a
    number's range, or a string's length)."""
    name: str
    kind: type
    required: bool = False
    default: Any = None
    low: float | None = None
    high: float | None = None

    def checked(self, value: Any) -> Any:
        if value is None:
            if self.required:
                raise _bad(f"argument {self.name!r} is required")
            return self.default
        if not _is(value, self.kind):
            raise _bad(f"argument {self.name!r} must be {self.kind.__name__}, not {type(value).__name__}")
        if self.kind is float and not math.isfinite(value):   # nan passes every range check
            raise _bad(f"argument {self.name!r} must be a finite number, not {value}")
        size = len(value) if self.kind is str else value
        if (self.low is not None and size < self.low) or (self.high is not None and size > self.high):
            what = "length" if self.kind is str else "value"
            raise _bad(f"argument {self.name!r}: {what} {size} is outside [{self.low}, {self.high}]")
        return float(value) if self.kind is float else value


@dataclass(frozen=True)
class ControlOp:
    name: str
    summary: str
    access: Access
    runs_in: Place
    handler: str
    args: tuple[Arg, ...] = ()

    def checked_args(self, args: dict) -> dict:
        """Every declared argument, checked, with its default where it was not given;
        BAD_REQUEST for one that is not declared (as on the client socket, section 2)."""
        unknown = sorted(str(name) for name in args if name not in {a.name for a in self.args})
        if unknown:
            raise _bad(f"control op {self.name!r} takes no argument {', '.join(map(repr, unknown))}")
        return {a.name: a.checked(args.get(a.name)) for a in self.args}


TENANT_NAME = dict(low=1, high=64)    # as the header's `tenant` (PROTOCOL.md section 2)
CONTEXT_ID = dict(low=1, high=256)
MODEL_NAME = dict(low=1, high=64)     # as a name in [models] (config/models.py)
MODEL_VERSION = (Arg("model", str, required=True, **MODEL_NAME), Arg("version", str, required=True, **MODEL_NAME))
LIST_LIMIT = 1000                     # contexts one `contexts.list` returns when not told; the total is always given

OPS = {op.name: op for op in (
    ControlOp("ping", "is the supervisor there", Access.ANYONE, Place.SUPERVISOR, "ping"),
    ControlOp("status", "processes, devices, queues, caches, latency", Access.ANYONE, Place.SUPERVISOR, "status"),
    ControlOp("version", "the daemon's versions", Access.PRIVILEGED, Place.SUPERVISOR, "version"),
    ControlOp("config", "the effective configuration", Access.PRIVILEGED, Place.SUPERVISOR, "config"),
    ControlOp("workers", "every worker and its device", Access.PRIVILEGED, Place.SUPERVISOR, "workers"),
    ControlOp("workers.restart", "restart one worker", Access.PRIVILEGED, Place.SUPERVISOR, "restart_worker",
              (Arg("index", int, required=True, low=0, high=255),)),
    ControlOp("drain", "stop admitting new work", Access.PRIVILEGED, Place.FRONTEND, "drain"),
    ControlOp("resume", "admit new work again", Access.PRIVILEGED, Place.FRONTEND, "resume"),
    ControlOp("reload", "re-read the config file and apply what can change live", Access.PRIVILEGED,
              Place.EVERY_PROCESS, "reload", (Arg("timeout_s", float, low=0, high=3600),)),
    ControlOp("contexts.list", "contexts of every tenant, or of one", Access.PRIVILEGED, Place.SCHEDULER,
              "list_contexts", (Arg("owner", str, **TENANT_NAME), Arg("limit", int, default=LIST_LIMIT, low=1,
                                                                       high=1_000_000))),
    ControlOp("contexts.show", "one context's version, fields and sizes", Access.PRIVILEGED, Place.SCHEDULER,
              "show_context", (Arg("owner", str, default=DEFAULT_TENANT, **TENANT_NAME),
                               Arg("id", str, required=True, **CONTEXT_ID))),
    ControlOp("contexts.drop", "delete one context and its journal entries", Access.PRIVILEGED, Place.SCHEDULER,
              "drop_context", (Arg("owner", str, default=DEFAULT_TENANT, **TENANT_NAME),
                               Arg("id", str, required=True, **CONTEXT_ID))),
    ControlOp("models.promote", "send every new request of a model to one version", Access.PRIVILEGED,
              Place.SCHEDULER, "promote_version", MODEL_VERSION),
    ControlOp("models.split", "spread a model's new requests over versions by weight", Access.PRIVILEGED,
              Place.SCHEDULER, "split_versions", (Arg("model", str, required=True, **MODEL_NAME),
                                                  Arg("weights", dict, required=True))),
    ControlOp("models.rollback", "back to a model's policy before its last promote or split", Access.PRIVILEGED,
              Place.SCHEDULER, "roll_back_version", (Arg("model", str, required=True, **MODEL_NAME),)),
    ControlOp("models.shadow", "run a share of a model's requests on a candidate version too, and compare",
              Access.PRIVILEGED, Place.SCHEDULER, "shadow_version",
              (Arg("model", str, required=True, **MODEL_NAME), Arg("version", str, **MODEL_NAME),
               Arg("fraction", float, default=0.1, low=0, high=1))),
    ControlOp("models.load", "start a version's workers; it takes requests", Access.PRIVILEGED, Place.SCHEDULER,
              "load_version", MODEL_VERSION),
    ControlOp("models.unload", "stop a version's workers once its requests are done", Access.PRIVILEGED,
              Place.SCHEDULER, "unload_version", MODEL_VERSION),
    ControlOp("keys.list", "the server's public key and the allowed client keys", Access.PRIVILEGED,
              Place.SUPERVISOR, "keys_list"),
    ControlOp("keys.allow", "let the holder of a public key connect as a tenant", Access.PRIVILEGED,
              Place.SUPERVISOR, "keys_allow", (Arg("name", str, required=True), Arg("public_key", str, required=True))),
    ControlOp("keys.revoke", "refuse a client key from now on", Access.PRIVILEGED, Place.SUPERVISOR,
              "keys_revoke", (Arg("name", str, required=True),)),
    ControlOp("keys.api.add", "a new HTTP API key for a tenant (shown once, stored hashed)", Access.PRIVILEGED,
              Place.SUPERVISOR, "keys_api_add", (Arg("name", str, required=True),)),
    ControlOp("keys.api.revoke", "refuse a tenant's HTTP API key from now on", Access.PRIVILEGED,
              Place.SUPERVISOR, "keys_api_revoke", (Arg("name", str, required=True),)),
)}


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


def _is(value: Any, kind: type) -> bool:
    if isinstance(value, bool):   # msgpack's true is not 1
        return kind is bool
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


def _bad(message: str) -> MCPDError:
    return MCPDError(codes.BAD_REQUEST, message)
