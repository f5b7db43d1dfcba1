"""The scheduler's status report: what `status`, the supervisor's stats and the cluster heartbeat
read of it, built from its queue, its workers and its policies."""
from __future__ import annotations

import msgspec

from mcpd.daemon.child_stats import ClassQueue
from mcpd.daemon.model_stats import ModelsStats, VersionStats
from mcpd.daemon.scheduler import handler_lanes


def models_stats(scheduler) -> ModelsStats:
    """traffic.py's view of each model, with each version's ready workers, its requests waiting,
    running and answered, and its answers' recent latency."""
    shadows = scheduler.shadow.describe()
    latency = scheduler.answer_latency.summary()
    models = {name: msgspec.structs.replace(model, shadow=shadows.get(name), versions={
        version: _version_stats(scheduler, (name, version), figures, latency.get((name, version)))
        for version, figures in model.versions.items()}) for name, model in scheduler.traffic.describe().items()}
    return ModelsStats(scheduler.traffic.default_model, models)


def _version_stats(scheduler, served: tuple[str, str], routed: VersionStats, latency) -> VersionStats:
    serving = scheduler.serving(served)
    return msgspec.structs.replace(
        routed, workers=sorted(s.index for s in serving if s.ready), queued=scheduler.queue.waiting_for(served),
        running=sum(len(s.jobs) for s in serving), answered=scheduler.answered.get(served, 0), latency=latency,
        kind=handler_lanes.kind_of(scheduler.config, served), signature=scheduler.signatures.get(served))


def node_load(scheduler) -> dict:
    """What this node's cluster heartbeat carries: its load, free KV blocks and the models it serves."""
    ready = [s for s in scheduler.workers.values() if s.ready]
    free_kv = sum((s.info.kv_blocks_total or 0) - (s.info.kv_blocks_used or 0) for s in ready)
    served = sorted({f"{s.info.served_model}/{s.info.version}" for s in ready})
    return {"queued": len(scheduler.queue), "inflight": len(scheduler.jobs), "free_kv_blocks": free_kv,
            "models": served}


def stats(scheduler) -> dict:
    now = scheduler.clock()
    depths = scheduler.queue.depths()
    return {"queue_depth": len(scheduler.queue), "dispatched": scheduler.dispatched, "inflight": len(scheduler.jobs),
            "policy": scheduler.config.scheduler.policy, "degradation_level": scheduler.admission.ladder.level(now),
            "fast_rung": scheduler.admission.fast.describe(), "edge_shed": scheduler.admission.edge.describe(now),
            "classes": {name: ClassQueue(depths.get(name, 0), _max_queue(scheduler, name), round(w.window_ms, 3),
                                         round(w.p99_ms(), 3)) for name, w in scheduler.windows.items()},
            "errors": {name: dict(by_code) for name, by_code in scheduler.errors.items()},
            "contexts": scheduler.contexts.stats(), "models": models_stats(scheduler),
            "cache": cache.arena.stats() if (cache := scheduler.persistence.cache) else None,
            "persistence": scheduler.persistence.journal.stats(),
            "queue_time": {name: h.snapshot() for name, h in scheduler.queue_time.items()},
            "workers": [s.stats() for s in sorted(scheduler.workers.values(), key=lambda s: s.index)]}


def _max_queue(scheduler, name: str) -> int | None:
    """A class's queue cap; None for one a reload removed (its window stays for its last requests)."""
    cls = scheduler.config.scheduler.classes.get(name)
    return cls.max_queue if cls else None
