"""The Prometheus endpoint, scraped while the daemon works: counters move, histograms are sane."""
import select
import socket
import threading
import urllib.parse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mcpd.client import Client
from mcpd.daemon.frontend.request_metrics import MAX_TENANT_LABELS, OTHER_TENANTS, RequestMetrics
from mcpd.daemon.supervisor.metrics_server import IDLE_S, MAX_CONNECTIONS


@pytest.fixture(scope="module")
def d(module_daemon):
    return module_daemon(metrics={"listen": "127.0.0.1:0"})


def scrape(d) -> dict:
    """{(sample name, sorted label items): value} of one scrape."""
    with urllib.request.urlopen(d.status()["metrics"], timeout=30) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, items), v in samples.items() if n == name and set(labels.items()) <= set(items))


def load(d, count: int) -> None:
    def one(i):
        with d.client() as client:
            list(client.generate(f"m{i}", max_tokens=6, ignore_eos=True, stream=True))
            client.call("generate", {"prompt": f"n{i}", "max_tokens": 3, "ignore_eos": True}, priority="high")
    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)


def wait_for_counts(d, at_least: float) -> dict:
    holder = {}

    def enough():
        holder["s"] = scrape(d)
        return total(holder["s"], "mcpd_requests_total", op="generate", code="OK") >= at_least
    d.wait_until(enough, 30, f"{at_least} generate requests counted")
    return holder["s"]


MOVING = ("mcpd_generation_tokens_total", "mcpd_prompt_tokens_total", "mcpd_batch_size_count",
          "mcpd_request_duration_seconds_count", "mcpd_time_to_first_token_seconds_count")


def test_counters_move_under_load(d):
    load(d, 4)
    wait_for_counts(d, 8)
    # Worker figures arrive with the workers' stats, every half second: wait for them too.
    seen = {}

    def all_counted() -> bool:
        seen["first"] = scrape(d)
        return all(total(seen["first"], n) > 0 for n in MOVING)
    d.wait_until(all_counted, 30, "worker figures")
    first = seen["first"]
    load(d, 4)
    second = wait_for_counts(d, 16)
    assert total(second, "mcpd_requests_total", op="generate", code="OK", **{"class": "high"}) >= 8
    d.wait_until(lambda: all(total(scrape(d), n) > total(first, n) for n in MOVING), 30, "every counter moved")


@pytest.mark.parametrize("name", ["mcpd_request_duration_seconds", "mcpd_time_to_first_token_seconds",
                                  "mcpd_inter_token_latency_seconds", "mcpd_queue_time_seconds", "mcpd_batch_size"])
def test_histograms_are_sane(d, name):
    load(d, 2)
    samples = wait_for_counts(d, 4)
    series = {items for (n, items) in samples if n == name + "_count"}
    assert series, f"no {name} series"
    for labels in series:
        buckets = sorted((float(dict(items)["le"]), v) for (n, items), v in samples.items()
                         if n == name + "_bucket" and set(labels) <= set(items))
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1][0] == float("inf")   # cumulative
        assert counts[-1] == samples[(name + "_count", labels)] > 0
        assert samples[(name + "_sum", labels)] > 0


def test_gauges_of_devices_processes_and_contexts(d):
    with d.client() as client:
        client.call("context.open", {"id": "metrics"})
    d.wait_until(lambda: total(scrape(d), "mcpd_contexts") >= 1, 30, "context counted")
    samples = scrape(d)
    assert total(samples, "mcpd_pool_bytes", worker="0", device="cpu") > 0
    assert total(samples, "mcpd_pool_in_use_bytes", worker="0") > 0
    assert ("mcpd_process_restarts_total", (("index", "0"), ("role", "worker"))) in samples
    assert ("mcpd_requests_waiting", (("class", "normal"),)) in samples
    assert not any(n.startswith("mcpd_gpu_") for n, _ in samples)   # no NVML on a CPU host


def test_requests_are_labelled_by_tenant_with_a_bounded_label_set(d):
    with Client(d.endpoint, tenant="alice") as client:
        client.generate("t", max_tokens=2, ignore_eos=True)
    d.wait_until(lambda: total(scrape(d), "mcpd_requests_total", tenant="alice", code="OK") >= 1, 30,
                 "alice's request counted")
    metrics = RequestMetrics()   # a client may name any tenant: the labels stay bounded
    for i in range(MAX_TENANT_LABELS + 50):
        metrics.started(i, "ping", "normal", f"made-up-{i}", "")
        metrics.ended(i, "OK")
    tenants = {row[2] for row in metrics.snapshot().finished}
    assert len(tenants) == MAX_TENANT_LABELS + 1 and OTHER_TENANTS in tenants


def test_journal_host_cache_kv_and_queue_limit_figures(d):
    """What the alert rules read: journal fsync time, cache and KV fill, each queue's limit."""
    with d.client() as client:
        client.call("context.open", {"id": "journal-figures"})
    d.wait_until(lambda: total(scrape(d), "mcpd_journal_fsync_seconds_count") >= 1, 30, "a journal fsync counted")
    samples = scrape(d)
    assert total(samples, "mcpd_journal_fsync_seconds_sum") > 0 and total(samples, "mcpd_journal_bytes") > 0
    assert 0 < total(samples, "mcpd_context_cache_used_bytes") < total(samples, "mcpd_context_cache_bytes")
    assert 0 <= total(samples, "mcpd_kv_blocks_used", worker="0") < total(samples, "mcpd_kv_blocks", worker="0")
    assert samples[("mcpd_requests_waiting_max", (("class", "critical"),))] == 256
    assert ("mcpd_queue_time_p99_seconds", (("class", "normal"),)) in samples


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


def test_idle_connections_take_a_bounded_number_of_the_supervisors_threads(d):
    """Connections that never send a request: at most MAX_CONNECTIONS threads serve them, the rest
    are closed at once, an idle one is closed after IDLE_S, and a scrape is served once they go."""
    scrape(d)
    before = threads_of(d.process.pid)
    host, port = urllib.parse.urlsplit(d.status()["metrics"]).netloc.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port)), timeout=IDLE_S * 3) for _ in range(3 * MAX_CONNECTIONS)]
    try:
        d.wait_until(lambda: sum(closed(sock) for sock in idle) >= 2 * MAX_CONNECTIONS, 30, "the ones past the bound closed")
        assert threads_of(d.process.pid) <= before + MAX_CONNECTIONS
        d.wait_until(lambda: all(closed(sock) for sock in idle), IDLE_S * 3, "the idle ones closed")
    finally:
        for sock in idle:
            sock.close()
    assert scrape(d)   # served again


def closed(sock: socket.socket) -> bool:
    """Whether the server has closed this connection (it never sends on one that sent nothing)."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
