"""What the scheduler does differently for a handler version (config: `handler`, handlers/): an
infer job is routed like a generate but never tokenized; it costs its rows in fair queueing;
its lane lets each worker hold enough requests to fill a batch. An op meant for the other kind
of model is refused, naming the kind."""
from __future__ import annotations

import msgspec

from mcpd.config import Config, VersionConfig
from mcpd.daemon.scheduler import context_inputs
from mcpd.daemon.scheduler.job import Job
from mcpd.protocol import codes
from mcpd.protocol.args import InferArgs
from mcpd.protocol.codes import MCPDError


def version_config(config: Config, served: tuple[str, str]) -> VersionConfig | None:
    """The version's config; None for [model] alone, or a model a reload removed (its last
    requests may still be queued)."""
    entry = config.models.get(served[0])
    return entry.versions.get(served[1]) if entry else None


def kind_of(config: Config, served: tuple[str, str]) -> str:
    version = version_config(config, served)
    return version.kind if version else "language"


def check_kind(config: Config, served: tuple[str, str], args) -> None:
    """BAD_REQUEST for an infer on a language model or a generate on a handler model."""
    kind = kind_of(config, served)
    infer = isinstance(args, InferArgs)
    if infer and kind != "handler":
        raise MCPDError(codes.BAD_REQUEST, f"model {served[0]!r} is a language model: use generate")
    if not infer and kind == "handler":
        raise MCPDError(codes.BAD_REQUEST, f"model {served[0]!r} is a handler model: use infer")


def price(job: Job, args: InferArgs) -> None:
    """An infer's cost is its rows: what its share of a batch is."""
    job.cost, job.length_bin = max(1, args.rows), 0


def resolve_context_inputs(scheduler, job: Job, args: InferArgs) -> InferArgs:
    """An infer's args as its worker takes them: the context fields it names made inputs, its
    appends committed first (context_inputs.py); the job then carries those and their frames."""
    if args.context is None:
        return args
    resolved = context_inputs.resolve(scheduler.contexts.store, job.request.tenant, args, job.payload,
                                      scheduler.config.limits, scheduler.signatures.get(job.served))
    job.as_sent = (job.request, job.payload)
    job.request = msgspec.structs.replace(job.request, args=resolved.args)
    job.payload, job.context_version = resolved.payload, resolved.context_version
    return resolved.args


def inflight_cap(config: Config, served: tuple[str, str] | None, per_worker: int) -> int:
    """Requests a worker of the lane may hold: a handler's, at least two batches' worth, so one
    batch fills while the other runs."""
    version = version_config(config, served) if served is not None else None
    return max(per_worker, 2 * version.batching.max_batch_size) if version and version.handler else per_worker
