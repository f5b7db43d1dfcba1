"""The status report `mcpctl status` shows, assembled from the children's latest stats."""
from __future__ import annotations

import os
import time

import mcpd
from mcpd.daemon import channels
from mcpd.memory.host_segment import CONTEXT, CONTEXT_DELTA, KV_BLOCK


def build_status(supervisor) -> dict:
    table = supervisor.table
    frontend = (table.find("frontend", 0).stats or {})
    scheduler = (table.find("scheduler", 0).stats or {})
    workers = [c for c in table.children if c.spec.role == "worker"]
    return {
        "version": mcpd.__version__,
        "pid": os.getpid(),
        "state": _state(supervisor),
        "healthy": table.healthy() and not supervisor.stopping,
        "draining": bool(frontend.get("draining")),
        "uptime_s": round(time.monotonic() - supervisor.started, 1),
        "runtime_dir": str(supervisor.config.runtime_dir),
        "endpoints": frontend.get("endpoints", []) or _configured_endpoints(supervisor),
        "metrics": supervisor.metrics_address and f"http://{supervisor.metrics_address}/metrics",
        "processes": [{"role": "supervisor", "index": 0, "pid": os.getpid(), "state": "running",
                       "uptime_s": round(time.monotonic() - supervisor.started, 1), "restarts": 0,
                       "last_exit": ""}] + [c.describe() for c in table.children],
        "devices": [_device(c) for c in workers],
        "queue": {"depth": scheduler.get("queue_depth", 0),
                  "inflight": frontend.get("inflight", 0)},
        "cache": _cache(scheduler.get("cache"), workers),
        # Per priority class: queued, batching window_ms, queue_p99_ms; errors the scheduler
        # decided, by class then code; the degradation ladder's step (0 none, 1 cap, 2 shed).
        "scheduler": {key: scheduler.get(key, default) for key, default in
                      (("policy", ""), ("classes", {}), ("errors", {}), ("degradation_level", 0))},
        "contexts": _contexts(scheduler),
        "requests": {"served": frontend.get("served", 0), "errors": frontend.get("errors", {}),
                     "latency": frontend.get("latency", {}),
                     # Replies waiting for clients that do not read; client connections watched
                     # for unfinished messages, and those cut for holding too much.
                     "backlog": frontend.get("backlog", {}), "incoming": frontend.get("incoming", {})},
    }


def _contexts(scheduler: dict) -> dict:
    persistence = scheduler.get("persistence", {})
    return {**scheduler.get("contexts", {"contexts": 0, "bytes": 0}), "restored": persistence.get("restored", 0),
            "persistence": persistence}


def _state(supervisor) -> str:
    if supervisor.stopping:
        return "stopping"
    if not supervisor.announced_ready:
        return "starting"
    if (supervisor.table.find("frontend", 0).stats or {}).get("draining"):
        return "draining"
    return "ready" if supervisor.table.healthy() else "degraded"


def _configured_endpoints(supervisor) -> list[str]:
    config = supervisor.config
    return [channels.client_endpoint(config.runtime_dir)] + ([config.server.tcp] if config.server.tcp else [])


def _cache(arena: dict | None, workers: list) -> dict:
    """The host shared-memory cache: the arena's own figures (the scheduler reads them from the
    segment), and the KV blocks workers moved in and out of it."""
    if not arena:
        return {"enabled": False}
    by_kind = arena["entries_by_kind"]
    moved = {name: sum((w.stats or {}).get(name, 0) for w in workers) for name in ("host_kv_loaded", "host_kv_saved")}
    return {"enabled": True, **{k: v for k, v in arena.items() if k != "entries_by_kind"},
            "contexts": by_kind[CONTEXT], "context_deltas": by_kind[CONTEXT_DELTA], "kv_blocks": by_kind[KV_BLOCK],
            "kv_blocks_loaded": moved["host_kv_loaded"], "kv_blocks_saved": moved["host_kv_saved"]}


def _device(worker) -> dict:
    stats = worker.stats or {}
    keep = ("device", "model", "dtype", "running", "waiting", "preemptions", "kv_blocks_total",
            "kv_blocks_used", "kv_waste_frac", "pool", "tokens_generated", "host_kv_loaded", "host_kv_saved")
    return {"worker": worker.spec.index, **{k: stats[k] for k in keep if k in stats}}
