"""The status report `mcpctl status` shows, assembled from the children's latest stats."""
from __future__ import annotations

import os

import msgspec

import mcpd
from mcpd.daemon import channels
from mcpd.daemon.child_stats import HttpStats, WorkerStats
from mcpd.daemon.model_stats import ModelsStats
from mcpd.handlers.result_cache_stats import ResultCacheStats
from mcpd.memory.arena_stats import ArenaStats
from mcpd.memory.host_segment import CONTEXT, CONTEXT_DELTA, KV_BLOCK

DEVICE_FIGURES = ("device", "model", "served_model", "version", "dtype", "quantization", "kernels", "running", "waiting", "preemptions", "kv_blocks_total",
                  "kv_blocks_used", "kv_waste_frac", "pool", "tokens_generated", "tokens_prefilled",
                  "prefix_cache_queries", "prefix_cache_hits", "host_kv_loaded", "host_kv_saved")

RESULT_CACHE_FIGURES = ("entries", "bytes", "max_bytes", "hits", "misses", "evictions", "refused")


def build_status(supervisor) -> dict:
    table = supervisor.table
    frontend = table.find("frontend", 0).latest_stats()
    scheduler = table.find("scheduler", 0).latest_stats()
    workers = [c for c in table.children if c.spec.role == "worker"]
    return {
        "version": mcpd.__version__,
        "pid": os.getpid(),
        "state": _state(supervisor),
        "healthy": table.healthy() and not supervisor.stopping,
        "draining": frontend.draining,
        "uptime_s": round(supervisor.clock() - supervisor.started, 1),
        "runtime_dir": str(supervisor.config.runtime_dir),
        "endpoints": frontend.endpoints or _configured_endpoints(supervisor),
        "metrics": supervisor.metrics_address and f"http://{supervisor.metrics_address}/metrics",
        "http": _http(frontend.http),
        "processes": [{"role": "supervisor", "index": 0, "pid": os.getpid(), "state": "running",
                       "uptime_s": round(supervisor.clock() - supervisor.started, 1), "restarts": 0,
                       "last_exit": ""}] + [c.describe(supervisor.clock()) for c in table.children],
        "devices": [{"worker": w.spec.index, **w.latest_stats().reported(DEVICE_FIGURES)} for w in workers],
        "pools": [_pool(keeper) for keeper in table.children if keeper.spec.role == "keeper"],
        "queue": {"depth": scheduler.queue_depth, "inflight": frontend.inflight},
        "cache": _cache(scheduler.cache, [w.latest_stats() for w in workers]),
        # Per priority class: queued, max_queue, batching window_ms, queue_p99_ms; errors the scheduler
        # decided, by class then code; the degradation ladder's step (0 none, 1 cap, 2 shed).
        "scheduler": {"policy": scheduler.policy, "classes": scheduler.classes, "errors": scheduler.errors,
                      "degradation_level": scheduler.degradation_level, "fast_rung": scheduler.fast_rung or {},
                      "edge_shed": scheduler.edge_shed or {}},
        "models": _models(scheduler.models, workers),
        # This node, the live nodes it last saw and where it routed contexts' requests; {} when [cluster] is off.
        "cluster": {**(msgspec.to_builtins(scheduler.cluster) if scheduler.cluster else {}),
                    **({"routing": frontend.routing} if frontend.routing else {})},
        "contexts": {**(msgspec.to_builtins(scheduler.contexts) if scheduler.contexts else {"contexts": 0, "bytes": 0}),
                     "restored": scheduler.persistence.restored if scheduler.persistence else 0,
                     "persistence": scheduler.persistence or {}},
        "requests": {"served": frontend.served, "errors": frontend.errors, "latency": frontend.latency,
                     # Replies waiting for clients that do not read; client connections watched
                     # for unfinished messages, and those cut for holding too much.
                     "backlog": frontend.backlog, "incoming": frontend.incoming,
                     "slowest": frontend.slowest},   # the requests in flight longest, the oldest first
    }


def _models(scheduled: ModelsStats, workers: list) -> dict:
    """The scheduler's view of each model (traffic policy, versions: loaded, routed, queued,
    ready workers) with each version's worker processes and their state from the process table."""
    models = msgspec.to_builtins(scheduled.models)
    for worker in workers:
        spec = worker.spec
        figures = models.get(spec.model, {}).get("versions", {}).get(spec.version)
        if figures is not None:
            figures.setdefault("processes", []).append({"index": spec.index, "state": worker.state})
            _add_result_cache(figures, worker.latest_stats().result_cache)
    return {"default_model": scheduled.default_model, "models": models}


def _add_result_cache(figures: dict, cache: ResultCacheStats | None) -> None:
    """A handler version's result cache: its workers' caches summed, and the hit rate of all."""
    if cache is None:
        return
    total = figures.setdefault("result_cache", dict.fromkeys(RESULT_CACHE_FIGURES, 0))
    for name in RESULT_CACHE_FIGURES:
        total[name] += getattr(cache, name)
    asked = total["hits"] + total["misses"]
    total["hit_rate"] = total["hits"] / asked if asked else 0.0


def _http(stats: HttpStats | None) -> dict:
    """The OpenAI-compatible listener in the front-end: off, or its figures with its address as a URL."""
    if stats is None:
        return {"enabled": False}
    figures = msgspec.to_builtins(stats)   # without the connection figures it has not reported yet
    return {"enabled": True, "url": f"http://{figures.pop('listen')}", **figures}


def _pool(keeper) -> dict:
    """A device pool, its keeper (the owner of the memory) and its regions, each with the worker
    that owns it."""
    stats = keeper.latest_stats()
    return {"device": keeper.spec.device, "keeper": keeper.spec.index,
            "keeper_pid": keeper.process.pid if keeper.alive else None, "path": stats.path,
            **(msgspec.to_builtins(stats.pool) if stats.pool else {})}


def _state(supervisor) -> str:
    if supervisor.stopping:
        return "stopping"
    if not supervisor.announced_ready:
        return "starting"
    if supervisor.table.find("frontend", 0).latest_stats().draining:
        return "draining"
    return "ready" if supervisor.table.healthy() else "degraded"


def _configured_endpoints(supervisor) -> list[str]:
    config = supervisor.config
    return [channels.client_endpoint(config.runtime_dir)] + ([config.server.tcp] if config.server.tcp else [])


def _cache(arena: ArenaStats | None, workers: list[WorkerStats]) -> dict:
    """The host shared-memory cache: the arena's own figures (the scheduler reads them from the
    segment), and the KV blocks workers moved in and out of it."""
    if arena is None:
        return {"enabled": False}
    figures = msgspec.structs.asdict(arena)
    by_kind = figures.pop("entries_by_kind")
    return {"enabled": True, **figures,
            "contexts": by_kind[CONTEXT], "context_deltas": by_kind[CONTEXT_DELTA], "kv_blocks": by_kind[KV_BLOCK],
            "kv_blocks_loaded": sum(w.host_kv_loaded or 0 for w in workers),
            "kv_blocks_saved": sum(w.host_kv_saved or 0 for w in workers)}
