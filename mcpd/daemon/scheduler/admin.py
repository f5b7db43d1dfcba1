"""The scheduler's side of mcpctl: context ops across tenants and model traffic ops (Admin), and
live reload (Reload).

The supervisor owns the control socket but the contexts live here, so it forwards these ops on
sched.ipc; answers go back as events on the EventReporter, matched by the supervisor's token.
Nothing here waits: a reply is one event, so a slow mcpctl never holds up scheduling. One op is
answered later: `models.unload`, once the version has no request left and its workers' replies
reached the front-end (unload.py; Scheduler.tick sends it); the supervisor then stops the
version's workers (admin.py).
"""
from __future__ import annotations

from mcpd.contexts.context import Context
from mcpd.daemon import live_config, messages
from mcpd.protocol import codes, control_ops
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.error import ErrorReply
from mcpd.protocol.control_args import ContextListing, ContextRef, ModelRef, ModelVersion, ShadowPlan, TrafficSplit
from mcpd.protocol.control_results import (ContextDetail, ContextDropped, ContextField, ContextList, ContextSummary,
                                           ShadowSetting, TrafficPolicy, VersionState)


def handle(scheduler, request: messages.Admin) -> None:
    """Run one Admin op from the supervisor. Its args were decoded into the op's struct there;
    its handler here is the function the table names."""
    token = request.token
    try:
        op = control_ops.find(request.op)
        if op.runs_in is not control_ops.Place.SCHEDULER:
            raise MCPDError(codes.UNKNOWN_OP, f"control op {op.name!r} does not run in the scheduler")
        result = globals()[op.handler](scheduler, request.args, token)
        if result is not LATER:
            scheduler.events.send(messages.AdminAnswer, token, result=result)
    except MCPDError as e:
        scheduler.events.send(messages.AdminAnswer, token, error=ErrorReply.of(e))
    except Exception as e:   # a bug in one op answers that op; it must not take the scheduler down
        scheduler.log.exception("control op %r failed", request.op)
        scheduler.events.send(messages.AdminAnswer, token, error=ErrorReply.internal(e))


LATER = object()   # a handler's result: it answers the op itself, later


def list_contexts(scheduler, args: ContextListing, _token: int) -> ContextList:
    owner = args.owner
    found = sorted((c for c in scheduler.contexts.store.contexts.values() if owner in (None, c.owner)), key=lambda c: (c.owner, c.id))
    return ContextList(len(found), [ContextSummary(**_summary(c)) for c in found[:args.limit]])


def show_context(scheduler, args: ContextRef, _token: int) -> ContextDetail:
    context = scheduler.contexts.store.get(args.owner, args.id)
    fields = [_field(context, name, value) for name, value in sorted(context.fields.items())]
    return ContextDetail(**{**_summary(context), "fields": fields})


def drop_context(scheduler, args: ContextRef, _token: int) -> ContextDropped:
    return ContextDropped(scheduler.contexts.store.drop(args.owner, args.id))


def promote_version(scheduler, args: ModelVersion, _token: int) -> TrafficPolicy:
    return scheduler.traffic.promote(args.model, args.version)


def split_versions(scheduler, args: TrafficSplit, _token: int) -> TrafficPolicy:
    return scheduler.traffic.split(args.model, args.weights)


def roll_back_version(scheduler, args: ModelRef, _token: int) -> TrafficPolicy:
    return scheduler.traffic.rollback(args.model)


def shadow_version(scheduler, args: ShadowPlan, _token: int) -> ShadowSetting:
    return scheduler.set_shadow(args.model, args.version, args.fraction)


def load_version(scheduler, args: ModelVersion, _token: int) -> VersionState:
    """Takes requests from now on (they wait for its workers, which the supervisor starts)."""
    scheduler.load_version(args.model, args.version)
    return VersionState(args.model, args.version, loaded=True)


def unload_version(scheduler, args: ModelVersion, token: int):
    """Takes no new request from now on; answered once those it has are done and relayed (unload.py)."""
    scheduler.unload_version(args.model, args.version, token)
    return LATER


def _summary(context: Context) -> dict:
    return {"owner": context.owner, **context.describe(), "busy": context.busy_with is not None,
            "kv_version": context.kv_version}


def _field(context: Context, name: str, value) -> ContextField:
    shape = getattr(value, "shape", None)
    return ContextField(name, type(value).__name__, str(getattr(value, "dtype", "")) or None,
                        list(shape) if shape is not None else None, context.changed_at.get(name, 0))


def reload(scheduler, reload: messages.Reload) -> None:
    """Log level here, the [scheduler] section through apply_config, and the same message on to
    every worker (they confirm on their own)."""
    applied = live_config.apply_log_level(reload.config) + scheduler.apply_config(reload.config)
    for slot in scheduler.workers.values():
        if slot.ready:
            scheduler.send_worker(slot, [(reload,)])
    scheduler.events.send(messages.Reloaded, reload.token, applied)
