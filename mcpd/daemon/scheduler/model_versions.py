"""Which model versions the scheduler serves, changed while it runs: a model's traffic policy on
reload, a version loaded or unloaded (unload.py), and the shadow candidate that a share of a
model's requests is copied to (shadow.py)."""
from __future__ import annotations

import dataclasses

import msgspec

from mcpd.config import Config
from mcpd.daemon import messages
from mcpd.daemon.scheduler.job import Job
from mcpd.daemon.scheduler.shadow import ShadowBook
from mcpd.daemon.scheduler.unload import Unload
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.control_results import ShadowSetting, VersionState
from mcpd.protocol.error import ErrorReply


def apply_models(scheduler, config: Config) -> list[str]:
    """A model's traffic policy (its default version, its split) and the default model change
    live; its versions (paths, workers, ...) need a restart, and a model whose versions changed
    keeps everything as it was."""
    if not config.models:
        return []
    old = scheduler.config.model_table
    live = {name: entry for name, entry in config.models.items() if name in old and entry.versions == old[name].versions}
    default_model = config.default_model if config.default_model in old else scheduler.traffic.default_model
    applied = [f"models.{name}" for name in scheduler.traffic.configure(live, default_model)]
    shadows = {name: entry for name, entry in live.items()
               if (entry.shadow, entry.shadow_fraction) != (old[name].shadow, old[name].shadow_fraction)}
    configure_shadows(scheduler.shadow, shadows)
    applied += [f"models.{name}" for name in shadows if f"models.{name}" not in applied]
    if default_model != scheduler.config.default_model:
        applied.append("routing.default_model")
    scheduler.config = dataclasses.replace(
        scheduler.config, models={**scheduler.config.models, **live},
        routing=dataclasses.replace(scheduler.config.routing, default_model=default_model))
    return applied


def configure_shadows(shadow: ShadowBook, table: dict) -> None:
    for name, entry in table.items():
        shadow.set(name, entry.shadow, entry.shadow_fraction)


def set_shadow(scheduler, model: str, version: str | None, fraction: float) -> ShadowSetting:
    """Shadow `fraction` of `model`'s requests on `version` (a loaded one; None: off)."""
    if version is not None:
        scheduler.traffic.check_loaded(model, version)
    else:
        scheduler.traffic.check_model(model)
    return scheduler.shadow.set(model, version or "", fraction)


def queue_shadow_copy(scheduler, job: Job, now: float) -> None:
    """Queue a copy of the job on its model's shadow candidate, if this one is due for it
    (shadow.py), as the least important request there is: not at all when the node is busy."""
    model, version = job.served
    candidate = scheduler.shadow.candidate(model)
    if candidate is None or candidate == version:
        return
    sched = scheduler.config.scheduler
    if scheduler.admission.ladder.level(now) or len(scheduler.queue) >= sched.degrade_queue_depth:
        scheduler.shadow.models[model].shed += 1
        return
    lowest = min(sched.classes, key=lambda name: sched.classes[name].rank)
    rid = next(scheduler.shadow_rids)
    sampling = msgspec.structs.replace(job.request.args.sampling, logprobs=True)
    args = msgspec.structs.replace(job.request.args, stream=False, sampling=sampling, version=candidate)
    request = msgspec.structs.replace(job.request, rid=rid, priority=lowest, timeout_ms=None, args=args)
    copy = Job(rid, request, [], class_name=lowest, client=job.client, cost=job.cost, length_bin=job.length_bin,
               prefills=True, seq=next(scheduler.arrivals), enqueued=now,
               prompt_ids=job.prompt_ids, served=(model, candidate), compare=True)
    job.compare = True
    scheduler.shadow.start(model, job.rid, rid)
    scheduler.queue.push(copy, scheduler.admission.tenants.weight(copy.client))
    scheduler.may_place = True
    scheduler.jobs[rid] = copy


def load(scheduler, model: str, version: str) -> None:
    scheduler.traffic.load(model, version)
    unload = scheduler.unloading.pop((model, version), Unload())   # loaded again before its requests were done
    for token in unload.tokens:
        scheduler.events.send(messages.AdminAnswer, token, error=ErrorReply(
            codes.CONFLICT, f"version {version!r} of model {model!r} was loaded again before it unloaded"))


def unload(scheduler, model: str, version: str, token: int) -> None:
    """No new request goes to the version; the op is answered (and the supervisor stops its
    workers) once it has none queued or running and its workers' replies all reached the
    front-end (unload.py): an unload drops no request."""
    shadow = scheduler.shadow.models.get(model)
    if shadow and shadow.candidate == version and shadow.fraction:
        raise MCPDError(codes.CONFLICT, f"version {version!r} of model {model!r} is its shadow candidate: "
                                        "turn the shadow off first")
    scheduler.traffic.unload(model, version)
    pending = scheduler.unloading.setdefault((model, version), Unload())
    pending.tokens.append(token)
    pending.flushing = None   # asked again: a marker lost with a restarting front-end must not hold the op
    finish_unloads(scheduler)


def finish_unloads(scheduler) -> None:
    for served, pending in list(scheduler.unloading.items()):
        if not pending.asked and not _busy(scheduler, served):
            pending.flushing = _ask_to_flush(scheduler, served)
        if pending.done:
            del scheduler.unloading[served]
            for token in pending.tokens:
                scheduler.events.send(messages.AdminAnswer, token, result=VersionState(*served, loaded=False))


def forget_worker(scheduler, identity: bytes) -> None:
    """A worker flushed or gone: no unload waits on it any more."""
    for pending in scheduler.unloading.values():
        pending.forget(identity)


def _ask_to_flush(scheduler, served: tuple[str, str]) -> set[bytes] | None:
    """Send Flush to each of the version's ready workers: those it reached, or None if one's
    queue is full for now (they are all asked again on the next tick)."""
    flush = (messages.Flush(),)
    asked = set()
    for slot in scheduler.serving(served):
        if slot.ready and scheduler.send_worker(slot, [flush]):
            asked.add(slot.identity)
        elif slot.ready:
            return None
    return asked


def _busy(scheduler, served: tuple[str, str]) -> bool:
    return scheduler.queue.waiting_for(served) > 0 or any(s.jobs for s in scheduler.serving(served))
