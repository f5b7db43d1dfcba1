"""The Prometheus endpoint: one HTTP listener in the supervisor for the figures of every process.

Children already send their stats to the supervisor every 0.5 s; a custom collector turns the
latest of them into metric families at scrape time, so no child serves HTTP, nothing is shared
between processes, and a scrape costs the children nothing. Counters that a child keeps restart
from zero with it, which Prometheus reads as a counter reset (rate() copes).

Off by default ([metrics] listen = ""), loopback only unless allowed (config/listeners.py checks): the
figures name tenants' request rates. GPU utilisation and memory come from NVML when pynvml is
installed and a driver answers; otherwise those families are simply absent.
"""
from __future__ import annotations

import logging

import msgspec
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from mcpd.daemon.child_stats import HttpStats, JournalStats, SchedulerStats
from mcpd.daemon.frontend.request_metrics import MetricsSnapshot
from mcpd.daemon.supervisor import metrics_server
from mcpd.histogram import Snapshot



def serve(supervisor, log: logging.Logger) -> str | None:
    """Start the endpoint on [metrics] listen; returns its address (host:port, the port as
    bound), None where it could not start."""
    listen = supervisor.config.metrics.listen
    host, _, port = listen.rpartition(":")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(supervisor))
    try:
        server = metrics_server.start(host.strip("[]"), int(port), registry)
    except OSError as e:   # a taken port must not take the daemon down with it
        log.error("metrics endpoint %s not started: %s", listen, e)
        return None
    address = f"{host}:{server.server_port}"
    log.info("metrics on http://%s/metrics", address)
    return address


class DaemonCollector:
    def __init__(self, supervisor):
        self.supervisor = supervisor
        self.gpus = Gpus()

    def collect(self):
        table = self.supervisor.table
        frontend = table.find("frontend", 0).latest_stats()
        scheduler = table.find("scheduler", 0).latest_stats()
        workers = [c for c in table.children if c.spec.role == "worker"]
        yield from _requests(frontend.metrics, scheduler)
        yield _queue_limits(self.supervisor.config.scheduler.classes)
        yield from _workers(workers)
        yield from _handlers(workers)
        yield from _contexts(scheduler)
        yield from _cluster(scheduler)
        yield from _models(scheduler)
        yield from _http(frontend.http)
        restarts = CounterMetricFamily("mcpd_process_restarts", "Restarts of a child process", labels=["role", "index"])
        for child in table.children:
            restarts.add_metric([child.spec.role, str(child.spec.index)], child.restarts)
        yield restarts
        yield from self.gpus.collect()


def _requests(front: MetricsSnapshot, scheduler: SchedulerStats):
    finished = CounterMetricFamily("mcpd_requests", "Requests by op, priority class, tenant, model and final code",
                                   labels=["op", "class", "tenant", "model", "code"])
    for *labels, count in front.finished:
        finished.add_metric(labels, count)
    yield finished
    yield _histograms("mcpd_request_duration_seconds", "End-to-end request latency, at the front-end",
                      ["op", "class", "model"], [(row[:3], row[3]) for row in front.latency])
    yield _histograms("mcpd_time_to_first_token_seconds", "Time to the first streamed chunk", ["class"],
                      [([cls], h) for cls, h in front.ttft])
    yield _histograms("mcpd_inter_token_latency_seconds", "Time between streamed chunks", ["class"],
                      [([cls], h) for cls, h in front.itl])
    yield _histograms("mcpd_queue_time_seconds", "Time a request waited for a worker, per priority class",
                      ["class"], [([cls], h) for cls, h in sorted(scheduler.queue_time.items())])
    queue_p99 = GaugeMetricFamily("mcpd_queue_time_p99_seconds", "Recent queueing p99 the batching window steers, "
                                  "per class", labels=["class"])
    for cls, figures in sorted(scheduler.classes.items()):
        queue_p99.add_metric([cls], figures.queue_p99_ms / 1e3)
    yield queue_p99
    waiting = {name: figures.queued for name, figures in scheduler.classes.items()}
    inflight = front.inflight
    waiting_family = GaugeMetricFamily("mcpd_requests_waiting", "Requests queued for a worker", labels=["class"])
    running_family = GaugeMetricFamily("mcpd_requests_running", "Requests admitted and not waiting in the queue",
                                       labels=["class"])
    for cls in sorted(set(waiting) | set(inflight)):
        waiting_family.add_metric([cls], waiting.get(cls, 0))
        running_family.add_metric([cls], max(0, inflight.get(cls, 0) - waiting.get(cls, 0)))
    yield waiting_family
    yield running_family


def _queue_limits(classes: dict):
    """Each class's max_queue, so that a rule can read how full a queue is, not just how long."""
    family = GaugeMetricFamily("mcpd_requests_waiting_max", "Requests a class may queue before OVERLOADED",
                               labels=["class"])
    for name, cls in sorted(classes.items()):
        family.add_metric([name], cls.max_queue)
    return family


def _workers(workers):
    labels = ["worker", "device"]
    counters = {key: CounterMetricFamily(name, text, labels=labels) for key, name, text in (
        ("tokens_prefilled", "mcpd_prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded)"),
        ("tokens_generated", "mcpd_generation_tokens", "Tokens generated"),
        ("preemptions", "mcpd_preemptions", "Sequences preempted for KV space"))}
    gauges = {key: GaugeMetricFamily(name, text, labels=labels) for key, name, text in (
        ("in_use_bytes", "mcpd_pool_in_use_bytes", "Device pool bytes handed out (the KV region included)"),
        ("total_bytes", "mcpd_pool_bytes", "Device pool size"),
        ("internal_waste_frac", "mcpd_pool_internal_waste_ratio", "Bytes handed out beyond what was asked"),
        ("external_fragmentation", "mcpd_pool_fragmentation_ratio", "1 - largest free block / free bytes"),
        ("kv_waste_frac", "mcpd_kv_waste_ratio", "Unused token slots in held KV blocks"),
        ("kv_blocks_total", "mcpd_kv_blocks", "KV blocks the worker has room for"),
        ("kv_blocks_used", "mcpd_kv_blocks_used", "KV blocks held by sequences"),
        ("running", "mcpd_engine_running_sequences", "Sequences in the engine's running batch"),
        ("waiting", "mcpd_engine_waiting_sequences", "Sequences admitted to the engine, not yet running"))}
    batch = []
    for worker in workers:
        stats = worker.stats
        if stats is None:
            continue
        values = {**stats.reported(tuple(counters) + tuple(gauges)), **(msgspec.to_builtins(stats.pool) if stats.pool else {})}
        key = [str(worker.spec.index), stats.device or ""]
        for name, family in {**counters, **gauges}.items():
            if name in values:
                family.add_metric(key, values[name])
        if stats.batch_size is not None:
            batch.append((key, stats.batch_size))
    yield from counters.values()
    yield from gauges.values()
    yield _histograms("mcpd_batch_size", "Sequences per engine step", labels, batch)


def _handlers(workers):
    """Each handler worker's batches and result cache, labelled with the model version it serves
    (a dashboard shows them by model; the worker label alone would need a join)."""
    labels = ["model", "version", "worker"]
    batching = {key: kind(f"mcpd_handler_{key}", text, labels=labels) for key, kind, text in (
        ("batches", CounterMetricFamily, "Predicts a handler model's worker ran"),
        ("rows", CounterMetricFamily, "Rows those predicts ran"),
        ("padding_ratio", GaugeMetricFamily, "Padding's share of a handler's padded input elements"))}
    caches = {key: kind(f"mcpd_result_cache_{name}", text, labels=labels) for key, name, kind, text in (
        ("hits", "hits", CounterMetricFamily, "Handler requests answered from the result cache"),
        ("misses", "misses", CounterMetricFamily, "Handler requests the result cache did not hold"),
        ("evictions", "evictions", CounterMetricFamily, "Results evicted for a more often asked-for one"),
        ("refused", "refused", CounterMetricFamily, "Results not cached: asked for less often than their victims"),
        ("entries", "entries", GaugeMetricFamily, "Results held"),
        ("bytes", "bytes", GaugeMetricFamily, "Bytes the held results and their keys cost"),
        ("hit_rate", "hit_ratio", GaugeMetricFamily, "Hits over lookups since the worker started"))}
    for worker in workers:
        stats = worker.stats
        if stats is None:
            continue
        key = [stats.served_model or "", stats.version or "", str(worker.spec.index)]
        for name, value in stats.reported(tuple(batching)).items():
            batching[name].add_metric(key, value)
        if stats.result_cache is not None:
            for name, family in caches.items():
                family.add_metric(key, getattr(stats.result_cache, name))
    yield from batching.values()
    yield from caches.values()


def _http(listener: HttpStats | None):
    """The HTTP listener's answers by status (its requests are counted above, like any other)."""
    if listener is not None:
        family = CounterMetricFamily("mcpd_http_responses", "HTTP answers by status", labels=["status"])
        for status, count in sorted(listener.responses.items()):
            family.add_metric([status], count)
        yield family


def _models(scheduler: SchedulerStats):
    """Per model version: requests routed to it; per class: whether its fast rung is on; per
    model with a shadow: pairs compared and the identical ones."""
    routed = CounterMetricFamily("mcpd_model_requests", "Generate and infer requests routed per model version",
                                 labels=["model", "version"])
    compared = CounterMetricFamily("mcpd_shadow_compared", "Shadow pairs compared", labels=["model", "candidate"])
    identical = CounterMetricFamily("mcpd_shadow_identical", "Shadow pairs with identical tokens",
                                    labels=["model", "candidate"])
    for name, model in sorted(scheduler.models.models.items()):
        for version, figures in sorted(model.versions.items()):
            routed.add_metric([name, version], figures.routed)
        if model.shadow:
            compared.add_metric([name, model.shadow.candidate], model.shadow.compared)
            identical.add_metric([name, model.shadow.candidate], model.shadow.identical)
    fast = GaugeMetricFamily("mcpd_fast_rung_active", "1 while a class's requests go to fast versions",
                             labels=["class"])
    for name in sorted(scheduler.classes):
        fast.add_metric([name], int(scheduler.fast_rung is not None and name in scheduler.fast_rung.active))
    yield from (routed, compared, identical, fast)


def _contexts(scheduler: SchedulerStats):
    contexts = scheduler.contexts
    for name, text, value in (("mcpd_contexts", "Contexts held", contexts and contexts.contexts),
                              ("mcpd_contexts_bytes", "Bytes of all contexts", contexts and contexts.bytes),
                              ("mcpd_contexts_restored", "Contexts restored from disk at start",
                               scheduler.persistence and scheduler.persistence.restored)):
        if value is not None:
            yield GaugeMetricFamily(name, text, value=value)
    # The host shared-memory cache's arena, which the scheduler reads.
    yield from _reported("mcpd_context_cache_", msgspec.structs.asdict(scheduler.cache) if scheduler.cache else {}, (
        ("total_bytes", "bytes", GaugeMetricFamily, "Host cache size"),
        ("used_bytes", "used_bytes", GaugeMetricFamily, "Host cache bytes handed out"),
        ("entries", "entries", GaugeMetricFamily, "Host cache entries"),
        ("hits", "hits", CounterMetricFamily, "Host cache lookups that found their entry"),
        ("misses", "misses", CounterMetricFamily, "Host cache lookups that did not"),
        ("evictions", "evictions", CounterMetricFamily, "Host cache entries evicted for room")))
    yield from _journal(scheduler.persistence)


def _cluster(scheduler: SchedulerStats):
    """This node's view of the cluster and its Redis; nothing when [cluster] is off."""
    cluster = scheduler.cluster
    if cluster:
        yield GaugeMetricFamily("mcpd_cluster_live_nodes", "Nodes this one saw alive at its last heartbeat",
                                value=len(cluster.nodes))
        yield GaugeMetricFamily("mcpd_cluster_heartbeat_ok", "1 while this node's heartbeat reaches Redis",
                                value=int(cluster.heartbeat == "ok"))
        yield CounterMetricFamily("mcpd_cluster_contexts_prefetched", "Contexts loaded from Redis ahead of their "
                                  "first use, at start or takeover", value=cluster.prefetch.prefetched)
        if cluster.redis_rtt_ms is not None:
            yield GaugeMetricFamily("mcpd_cluster_heartbeat_rtt_seconds", "Round trips of this node's last "
                                    "heartbeat to Redis", value=cluster.redis_rtt_ms / 1000)
    redis = scheduler.contexts and scheduler.contexts.redis
    yield from _reported("mcpd_cluster_", msgspec.structs.asdict(redis) if redis else {}, (
        ("loaded", "contexts_loaded", CounterMetricFamily, "Contexts restored from Redis at first use"),
        ("folded", "folds", CounterMetricFamily, "Context logs in Redis folded into a snapshot"),
        ("refused", "redis_refusals", CounterMetricFamily, "Context ops refused because Redis could not take them"),
        ("behind", "contexts_behind", GaugeMetricFamily, "Contexts whose newest version Redis lacks (journal alone)")))


def _reported(prefix: str, figures: dict, table: tuple):
    """One metric per (key, name, kind, help text) of `table` whose key `figures` holds."""
    for key, name, kind, text in table:
        if key in figures:
            yield kind(prefix + name, text, value=figures[key])


def _journal(persistence: JournalStats | None):
    if persistence is not None:
        yield GaugeMetricFamily("mcpd_journal_bytes", "Bytes of the context journal since its snapshot",
                                value=persistence.journal_bytes)
        yield _histograms("mcpd_journal_fsync_seconds", "Time of one fdatasync of the context journal", [],
                          [([], persistence.fsync_seconds)])


def _histograms(name: str, text: str, labels: list[str], series: list[tuple[list[str], Snapshot]]):
    family = HistogramMetricFamily(name, text, labels=labels)
    for label_values, snapshot in series:
        cumulative, buckets = 0, []
        for bound, count in zip([*snapshot.bounds, "+Inf"], snapshot.counts):
            cumulative += count
            buckets.append((str(bound) if bound == "+Inf" else repr(float(bound)), cumulative))
        family.add_metric(label_values, buckets, snapshot.sum)
    return family


class Gpus:
    """GPU utilisation and memory through NVML, if pynvml and a driver are there."""

    def __init__(self):
        try:
            import pynvml   # optional: installed with the CUDA tooling, absent on CPU hosts
            pynvml.nvmlInit()
            self.nvml = pynvml
            self.count = pynvml.nvmlDeviceGetCount()
        except Exception:   # noqa: BLE001 - ImportError, or NVMLError without a driver: no GPU metrics
            self.nvml = None

    def collect(self):
        if self.nvml is None:
            return
        util = GaugeMetricFamily("mcpd_gpu_utilization_ratio", "GPU busy fraction (NVML)", labels=["gpu"])
        used = GaugeMetricFamily("mcpd_gpu_memory_used_bytes", "GPU memory in use (NVML)", labels=["gpu"])
        total = GaugeMetricFamily("mcpd_gpu_memory_total_bytes", "GPU memory (NVML)", labels=["gpu"])
        for index in range(self.count):
            handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
            memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            util.add_metric([str(index)], self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100)
            used.add_metric([str(index)], memory.used)
            total.add_metric([str(index)], memory.total)
        yield from (util, used, total)
