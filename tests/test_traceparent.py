"""W3C traceparent as mcpd reads it from clients (hostile: malformed is ignored, never an error),
the [tracing] section's checks, and tracing off loading nothing of OpenTelemetry."""
import subprocess
import sys

import pytest

from mcpd.config import ConfigError, from_dict
from mcpd.tracing import traceparent

TRACE = "0af7651916cd43dd8448eb211c80319c"
SPAN = "b7ad6b7169203331"


def test_a_valid_traceparent_names_its_trace_span_and_flags():
    parent = traceparent.parse(f"00-{TRACE}-{SPAN}-01")
    assert parent == (int(TRACE, 16), int(SPAN, 16), 1) and parent.sampled
    assert not traceparent.parse(f"00-{TRACE}-{SPAN}-00").sampled
    assert traceparent.encode(*parent) == f"00-{TRACE}-{SPAN}-01"


def test_a_later_version_may_carry_more_fields():
    assert traceparent.parse(f"01-{TRACE}-{SPAN}-01-extra") == (int(TRACE, 16), int(SPAN, 16), 1)


@pytest.mark.parametrize("value", [
    None, 7, b"00-" + TRACE.encode() + b"-" + SPAN.encode() + b"-01", ["00", TRACE, SPAN, "01"], "",
    f"00-{TRACE.upper()}-{SPAN}-01",          # uppercase hex
    f"ff-{TRACE}-{SPAN}-01",                  # version ff is forbidden
    f"00-{TRACE}-{SPAN}-01-more",             # version 00 has four fields exactly
    f"00-{'0' * 32}-{SPAN}-01",               # an all-zero trace id
    f"00-{TRACE}-{'0' * 16}-01",              # an all-zero span id
    f"00-{TRACE[:-1]}-{SPAN}-01",             # a short trace id
    f"00-{TRACE}-{SPAN}-1",                   # short flags
    f" 00-{TRACE}-{SPAN}-01",                 # leading space
    f"00-{TRACE}-{SPAN}-01\n",                # trailing newline
    f"00_{TRACE}_{SPAN}_01",
    f"01-{TRACE}-{SPAN}-01-" + "x" * 300,     # over the length bound
    f"00-{TRACE}-{SPAN}-0g",
    "0" * 10_000_000,                         # huge: refused on its length, before the pattern
])
def test_a_malformed_traceparent_is_ignored(value):
    assert traceparent.parse(value) is None


@pytest.mark.parametrize("section, message", [
    ({"sample_ratio": 1.5}, "tracing.sample_ratio = 1.5"),
    ({"sample_ratio": -0.1}, "tracing.sample_ratio = -0.1"),
    ({"exporter": "zipkin"}, "tracing.exporter = 'zipkin'"),
    ({"endpoint": "127.0.0.1:4318"}, "tracing.endpoint = '127.0.0.1:4318'"),
    ({"service_name": ""}, "tracing.service_name must not be empty"),
    ({"enabled": True, "exporter": "file"}, "tracing.path = '': the file exporter needs an absolute path"),
    ({"enabled": True, "exporter": "file", "path": "spans.jsonl"}, "tracing.path = 'spans.jsonl'"),
])
def test_a_bad_tracing_section_is_refused_naming_the_key(section, message):
    with pytest.raises(ConfigError) as raised:
        from_dict({"tracing": section})
    assert message in str(raised.value)


def test_tracing_is_off_by_default_and_a_file_exporter_validates():
    assert not from_dict({}).tracing.enabled
    config = from_dict({"tracing": {"enabled": True, "exporter": "file", "path": "/tmp/x.jsonl", "sample_ratio": 0}})
    assert config.tracing.sample_ratio == 0.0


def test_tracing_off_loads_no_opentelemetry_module_in_any_process_that_emits_spans():
    """Each process's recorder as its start builds it, with the default (off) config, in a fresh
    interpreter with the modules of the front-end, scheduler, worker and HTTP listener loaded."""
    code = """
import sys
from mcpd.config import from_dict
from mcpd import tracing
import mcpd.daemon.frontend.process, mcpd.daemon.scheduler.core, mcpd.daemon.worker.core, mcpd.http.routes
config = from_dict({"tracing": {"exporter": "file", "path": "/nonexistent/spans.jsonl"}})
assert [tracing.start(config, role) for role in ("frontend", "scheduler", "worker")] == [None] * 3
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def sampler(tmp_path, ratio: float):
    from mcpd.config.tracing import TracingConfig
    from mcpd.tracing.provider import Provider
    from mcpd.tracing.spans import Spans

    config = TracingConfig(enabled=True, exporter="file", path=str(tmp_path / "spans.jsonl"), sample_ratio=ratio)
    spans = Spans(Provider(config, "test"))
    spans.ids.seed(7)   # the draws are the same at every run
    return spans


@pytest.mark.parametrize("ratio", [0.0, 0.25, 1.0])
def test_a_request_is_sampled_by_its_trace_ids_low_bits_and_a_client_decides_for_its_own(tmp_path, ratio):
    spans = sampler(tmp_path, ratio)
    try:
        roots = [spans.root(None) for _ in range(4000)]
        sampled = [root for root in roots if root is not None]
        assert all(root.trace_id & (2**64 - 1) < ratio * 2**64 for root in sampled)
        fraction = len(sampled) / len(roots)
        assert fraction == ratio if ratio in (0.0, 1.0) else 0.2 < fraction < 0.3
        client = traceparent.parse(f"00-{TRACE}-{SPAN}-01")
        root = spans.root(client)
        assert root.trace_id == client.trace_id and root.span_id != client.span_id and root.sampled
        assert spans.root(traceparent.parse(f"00-{TRACE}-{SPAN}-00")) is None
    finally:
        spans.close()
