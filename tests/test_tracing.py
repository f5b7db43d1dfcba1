"""Tracing on a real daemon (127.0.0.1) with the file exporter: each request one trace across the
front-end, scheduler and worker processes, with the right parents, under a client's traceparent
from a ZeroMQ header or an HTTP header, a malformed one ignored; with tracing off, no file. And
the OTLP exporter, to a receiver on loopback. An infer on a handler model is traced the same way,
with its wait in the batcher, its batch and its predict on the worker.

The traffic runs once (module fixture), then the daemon stops, which exports what each process
still held; the tests read the spans it wrote. Each scenario runs as a tenant of its own, and
the root span names its tenant, so each test finds its own trace."""
import http.server
import json
import threading
import urllib.request
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mcpd.testing import free_port

pytestmark = pytest.mark.slow
MODEL = "mcpd-embedded-llama"
TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
PARENTS = {"zmq-parent": f"00-{TRACE}-{SPAN}-01", "http-parent": f"00-{TRACE[::-1]}-{SPAN}-01"}
MALFORMED = {"bad-version": f"ff-{TRACE}-{SPAN}-01", "bad-zero": f"00-{'0' * 32}-{SPAN}-01",
             "bad-long": f"01-{TRACE}-{SPAN}-01-" + "x" * 1000, "bad-type": 12345}
EVERY_REQUEST_SPAN = {"mcpd.request", "frontend.admit", "scheduler.admit", "scheduler.queue", "scheduler.dispatch",
                      "worker.generate", "worker.prefill", "worker.decode", "frontend.reply",
                      "hop.to_scheduler", "hop.to_worker", "hop.to_frontend"}
MAX_TOKENS = 8
STEP_TOKENS = 16   # engine.max_step_tokens: a longer prompt is prefilled in chunks of this many tokens
LONG_PROMPT = list(range(65, 105))   # 40 token ids: chunks of 16, 16 and 8


def read_spans(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def http_completion(daemon, tenant: str, headers: dict) -> int:
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"{daemon.base_url}/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "mcpd-tenant": tenant, **headers})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status


@pytest.fixture(scope="module")
def traced(module_daemon, tmp_path_factory):
    """(the spans written, the client's measured seconds of the plain generate)."""
    path = tmp_path_factory.mktemp("tracing") / "spans.jsonl"
    daemon = module_daemon(tracing={"enabled": True, "exporter": "file", "path": str(path)},
                           engine={"pool_bytes": 64 << 20, "decode_burst": 1, "max_step_tokens": STEP_TOKENS,
                                   "max_num_seqs": 4},
                           http={"listen": f"127.0.0.1:{free_port()}"})
    daemon.base_url = f"http://{daemon.control('config')['config']['http']['listen']}/v1"
    with daemon.client(tenant="plain") as client:
        client.generate("Hello", max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    with daemon.client(tenant="stream") as client:
        assert client.generate("Hello", max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stream=True).text()
    with daemon.client(tenant="chunked") as client:
        client.generate(prompt_token_ids=LONG_PROMPT, max_tokens=2, temperature=0, ignore_eos=True)
    with daemon.client(tenant="turn") as client:
        client.context("chat").generate("Hi there", max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    with daemon.client(tenant="zmq-parent") as client:
        client.call("generate", {"prompt": "Hello", "max_tokens": 4}, traceparent=PARENTS["zmq-parent"])
    for tenant, value in MALFORMED.items():
        with daemon.client(tenant=tenant) as client:
            assert client.call("generate", {"prompt": "Hello", "max_tokens": 4}, traceparent=value)["text"] is not None
    assert http_completion(daemon, "http-parent", {"traceparent": PARENTS["http-parent"]}) == 200
    assert http_completion(daemon, "http-bad", {"traceparent": f"00-{TRACE}-{SPAN}"}) == 200
    daemon.stop()
    return read_spans(path)


def trace_of(spans: list[dict], tenant: str, op: str = "generate") -> list[dict]:
    """Every span of the one trace whose root names `tenant` and `op`."""
    roots = [s for s in spans if s["name"] == "mcpd.request" and s["attributes"]["mcpd.tenant"] == tenant
             and s["attributes"]["mcpd.op"] == op]
    assert len(roots) == 1, roots
    return [s for s in spans if s["trace_id"] == roots[0]["trace_id"]]


def one(trace: list[dict], name: str) -> dict:
    found = [s for s in trace if s["name"] == name]
    assert len(found) == 1, (name, found)
    return found[0]


def within(child: dict, parent: dict) -> bool:
    return parent["start_ns"] <= child["start_ns"] <= child["end_ns"] <= parent["end_ns"]


@pytest.mark.parametrize("tenant", ["plain", "stream", "turn"])
def test_a_generate_is_one_trace_across_three_processes_with_the_right_parents(traced, tenant):
    trace = trace_of(traced, tenant)
    assert len(trace) >= 6 and EVERY_REQUEST_SPAN <= {s["name"] for s in trace}
    assert len({(s["resource"]["mcpd.process"], s["resource"]["process.pid"]) for s in trace}) >= 3
    root, worker = one(trace, "mcpd.request"), one(trace, "worker.generate")
    assert root["parent_span_id"] is None and root["status"] != "ERROR"
    for span in trace:
        process = span["resource"]["mcpd.process"]
        if span["name"] in ("worker.prefill", "worker.decode"):
            assert span["parent_span_id"] == worker["span_id"] and within(span, worker)
        elif span is not root:
            assert span["parent_span_id"] == root["span_id"], span["name"]
        if span["name"].startswith("frontend.") or span is root:
            assert process == "frontend" and within(span, root)
        else:
            assert process == recorder(span["name"])


def recorder(name: str) -> str:
    """The process that records a span: a hop's receiver, else the one its name begins with."""
    where = name.removeprefix("hop.to_") if name.startswith("hop.") else name.split(".")[0]
    return where + ("0" if where == "worker" else "")


def test_a_context_turn_has_its_commit_in_the_scheduler(traced):
    commit = one(trace_of(traced, "turn"), "scheduler.commit")
    assert commit["resource"]["mcpd.process"] == "scheduler"


def test_a_turns_hops_join_each_process_span_to_the_next(traced):
    """Each hop runs from its sender's moment of sending to its receiver's span: the time between
    processes is in the trace too, not only what each process did."""
    trace = trace_of(traced, "turn")
    hops = {(s["name"], s["attributes"].get("mcpd.from")): s for s in trace if s["name"].startswith("hop.")}
    assert set(hops) == {("hop.to_scheduler", "frontend"), ("hop.to_worker", "scheduler"),
                         ("hop.to_scheduler", "worker"), ("hop.to_frontend", None)}
    admit, dispatch = one(trace, "frontend.admit"), one(trace, "scheduler.dispatch")
    generate, commit, reply = one(trace, "worker.generate"), one(trace, "scheduler.commit"), one(trace, "frontend.reply")
    assert hops[("hop.to_scheduler", "frontend")]["start_ns"] == admit["end_ns"]
    assert hops[("hop.to_scheduler", "frontend")]["end_ns"] == one(trace, "scheduler.admit")["start_ns"]
    assert dispatch["start_ns"] <= hops[("hop.to_worker", "scheduler")]["start_ns"] <= dispatch["end_ns"]
    assert hops[("hop.to_worker", "scheduler")]["end_ns"] == generate["start_ns"]
    assert generate["end_ns"] <= hops[("hop.to_scheduler", "worker")]["start_ns"]
    assert hops[("hop.to_scheduler", "worker")]["end_ns"] == commit["start_ns"]
    assert commit["start_ns"] <= hops[("hop.to_frontend", None)]["start_ns"] <= commit["end_ns"]   # its last act
    assert hops[("hop.to_frontend", None)]["end_ns"] == reply["start_ns"]


def test_decode_steps_are_grouped_into_stretches_not_a_span_per_token(traced):
    """decode_burst 1: each of the 7 tokens after the prefill's first is a step of its own."""
    trace = trace_of(traced, "plain")
    decodes = [s for s in trace if s["name"] == "worker.decode"]
    assert sum(s["attributes"]["mcpd.tokens"] for s in decodes) == MAX_TOKENS - 1
    assert sum(s["attributes"]["mcpd.steps"] for s in decodes) == MAX_TOKENS - 1
    assert len(decodes) < MAX_TOKENS - 1
    assert sum(s["attributes"]["mcpd.tokens"] for s in trace if s["name"] == "worker.prefill") == \
        one(trace, "worker.generate")["attributes"]["mcpd.prompt_tokens"]


def test_each_prefill_chunk_is_a_span_of_its_own(traced):
    trace = trace_of(traced, "chunked")
    chunks = sorted((s for s in trace if s["name"] == "worker.prefill"), key=lambda s: s["start_ns"])
    assert [s["attributes"]["mcpd.tokens"] for s in chunks] == [16, 16, 8]
    assert all(a["end_ns"] <= b["start_ns"] for a, b in zip(chunks, chunks[1:]))


@pytest.mark.parametrize("tenant", PARENTS)
def test_a_clients_traceparent_is_the_parent_of_the_requests_root(traced, tenant):
    trace = trace_of(traced, tenant)
    root = one(trace, "mcpd.request")
    assert f"00-{root['trace_id']}-{root['parent_span_id']}-01" == PARENTS[tenant]
    assert len({s["resource"]["mcpd.process"] for s in trace}) == 3


@pytest.mark.parametrize("tenant", [*MALFORMED, "http-bad"])
def test_a_malformed_traceparent_is_ignored_and_the_request_traced_on_its_own(traced, tenant):
    trace = trace_of(traced, tenant)
    root = one(trace, "mcpd.request")
    assert root["trace_id"] not in (TRACE, TRACE[::-1]) and root["parent_span_id"] is None and root["status"] != "ERROR"
    assert EVERY_REQUEST_SPAN - {"worker.decode"} <= {s["name"] for s in trace}


def test_every_span_is_exported_once(traced):
    assert len({s["span_id"] for s in traced}) == len(traced)
    by_trace = defaultdict(list)
    for span in traced:
        by_trace[span["trace_id"]].append(span)
    assert all(sum(s["name"] == "mcpd.request" for s in spans) == 1 for spans in by_trace.values())


EVERY_INFER_SPAN = (EVERY_REQUEST_SPAN - {"worker.generate", "worker.prefill", "worker.decode"}
                    | {"worker.infer", "worker.queue", "worker.batch", "worker.predict"})
SCORER = "mcpd.handlers.examples.risk_scorer:RiskScorer"


def features(rows: int) -> np.ndarray:
    return np.ones((rows, 256), np.float32)


@pytest.fixture(scope="module")
def traced_infers(module_daemon, tmp_path_factory):
    """The spans of infers on a handler model whose batches go out only when full (2 rows): one
    request of 2 rows, and two of 1 row each, sent at once, which make one batch."""
    path = tmp_path_factory.mktemp("tracing") / "spans.jsonl"
    daemon = module_daemon(tracing={"enabled": True, "exporter": "file", "path": str(path)}, pool={"shared": False},
                           **{"models.risk": {}, "models.risk.versions.v1": {"handler": SCORER},
                              "models.risk.versions.v1.batching": {"max_batch_size": 2, "max_queue_delay_ms": 10_000.0}})
    with daemon.client(tenant="infer") as client:
        assert client.infer("risk", {"features": features(2)}).outputs["score"].shape == (2,)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda tenant: daemon.client(tenant=tenant).infer("risk", {"features": features(1)}),
                      ["batched-a", "batched-b"]))
    daemon.stop()
    return read_spans(path)


def test_an_infer_is_one_trace_with_its_queue_batch_and_predict_on_the_worker(traced_infers):
    trace = trace_of(traced_infers, "infer", "infer")
    assert EVERY_INFER_SPAN <= {s["name"] for s in trace}
    root, infer = one(trace, "mcpd.request"), one(trace, "worker.infer")
    queue, batch, predict = one(trace, "worker.queue"), one(trace, "worker.batch"), one(trace, "worker.predict")
    for span in trace:
        if span in (queue, batch, predict):
            assert span["parent_span_id"] == infer["span_id"] and within(span, infer)
        elif span is not root:
            assert span["parent_span_id"] == root["span_id"], span["name"]
            assert span["resource"]["mcpd.process"] == recorder(span["name"])
    assert queue["end_ns"] <= batch["start_ns"] <= batch["end_ns"] <= predict["start_ns"]
    assert predict["attributes"] == {"mcpd.batch_requests": 1, "mcpd.batch_rows": 2}


def test_requests_batched_together_share_the_batchs_spans_each_in_its_own_trace(traced_infers):
    predicts = [one(trace_of(traced_infers, tenant, "infer"), "worker.predict") for tenant in ("batched-a", "batched-b")]
    assert predicts[0]["trace_id"] != predicts[1]["trace_id"]
    assert all(p["attributes"] == {"mcpd.batch_requests": 2, "mcpd.batch_rows": 2} for p in predicts)
    assert predicts[0]["start_ns"] == predicts[1]["start_ns"] and predicts[0]["end_ns"] == predicts[1]["end_ns"]


def test_tracing_off_writes_nothing(fresh_daemon, tmp_path):
    path = tmp_path / "spans.jsonl"
    daemon = fresh_daemon(tracing={"enabled": False, "exporter": "file", "path": str(path)})
    with daemon.client() as client:
        assert client.generate("Hello", max_tokens=4, temperature=0).text is not None
    daemon.stop()
    assert not path.exists()


class Collector:
    """An OTLP/HTTP receiver on loopback: the spans of every export request it was sent."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        received = self.received = []   # (path, process, span name, trace id)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                export = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["Content-Length"])))
                for resource_spans in export.resource_spans:
                    process = {a.key: a.value for a in resource_spans.resource.attributes}["mcpd.process"].string_value
                    received.extend((self.path, process, span.name, span.trace_id.hex())
                                    for scope in resource_spans.scope_spans for span in scope.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"


def test_the_otlp_exporter_sends_every_processs_spans_to_the_configured_endpoint(fresh_daemon):
    collector = Collector()
    try:
        daemon = fresh_daemon(tracing={"enabled": True, "endpoint": collector.endpoint})
        with daemon.client(tenant="otlp") as client:
            client.call("generate", {"prompt": "Hello", "max_tokens": 4}, traceparent=PARENTS["zmq-parent"])
        daemon.stop()
    finally:
        collector.server.shutdown()
    ours = [(path, process, name) for path, process, name, trace_id in collector.received if trace_id == TRACE]
    assert {path for path, _, _ in ours} == {"/v1/traces"}
    assert {process for _, process, _ in ours} == {"frontend", "scheduler", "worker0"}
    assert EVERY_REQUEST_SPAN - {"worker.decode"} <= {name for _, _, name in ours}
