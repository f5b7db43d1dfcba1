"""/metrics by model, version and class, on a real daemon serving a language model and a handler
model: requests and their latency labelled with the model and class they named (only configured
ones: a client's invented names share one label), handler batches by model version, queue time by
class."""
import numpy as np
import pytest

from mcpd.client import Client
from mcpd.daemon.frontend.request_labels import UNKNOWN
from mcpd.histogram import LATENCY_BOUNDS
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.testing import Daemon
from test_metrics import scrape, total

SCORER = "mcpd.handlers.examples.risk_scorer:RiskScorer"
MODEL_LABELS = {"chat", "risk", UNKNOWN, ""}   # the configured models, the invented ones, ops without a model
CLASS_LABELS = {"critical", "high", "normal", "low", UNKNOWN}   # the default classes, the invented ones


@pytest.fixture(scope="module")
def daemon():
    d = Daemon(**{
        "pool": {"shared": False}, "metrics": {"listen": "127.0.0.1:0"},
        "models.chat": {}, "models.chat.versions.v1": {},   # the embedded language model, the default
        "models.risk": {}, "models.risk.versions.v1": {"handler": SCORER},
        "models.risk.versions.v1.cache": {"max_bytes": 1 << 20},
    })
    d.start()
    yield d
    d.stop()
    d.cleanup()


def features(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, 256)).astype(np.float32)


def wait_for(daemon, name: str, expected: float, what: str, **labels) -> dict:
    """The first scrape whose `name` samples with `labels` add up to `expected` (figures come in
    with the children's stats, every half second)."""
    seen = {}

    def counted() -> bool:
        seen["samples"] = scrape(daemon)
        return total(seen["samples"], name, **labels) == expected
    daemon.wait_until(counted, 30, what)
    return seen["samples"]


def test_requests_and_their_latency_are_labelled_with_their_model(daemon):
    with Client(daemon.endpoint, tenant="labelled") as client:
        for i in range(3):
            client.generate(f"p{i}", max_tokens=2, ignore_eos=True)   # no model named: the default, chat
        for i in range(4):
            client.infer("risk", {"features": features(1, i)})
        client.call("ping", {})
    samples = wait_for(daemon, "mcpd_requests_total", 8, "the tenant's 8 requests", tenant="labelled")
    assert total(samples, "mcpd_requests_total", tenant="labelled", op="generate", model="chat", code="OK") == 3
    assert total(samples, "mcpd_requests_total", tenant="labelled", op="infer", model="risk", code="OK") == 4
    assert total(samples, "mcpd_requests_total", tenant="labelled", op="ping", model="", code="OK") == 1
    assert total(samples, "mcpd_request_duration_seconds_count", op="infer", model="risk") >= 4
    assert total(samples, "mcpd_request_duration_seconds_count", op="generate", model="chat") >= 3


def test_a_model_name_no_config_has_makes_no_label_of_its_own(daemon):
    invented = 20
    with Client(daemon.endpoint, tenant="mallory") as client:
        for i in range(invented):
            with pytest.raises(MCPDError) as refused:
                if i % 2:
                    client.infer(f"made-up-{i}", {"features": features(1, i)})
                else:
                    client.generate("x", model=f"made-up-{i}", max_tokens=1)
            assert refused.value.code == codes.UNKNOWN_MODEL
    samples = wait_for(daemon, "mcpd_requests_total", invented, "the invented names' refusals", tenant="mallory",
                       model=UNKNOWN, code=codes.UNKNOWN_MODEL)
    for family in ("mcpd_requests_total", "mcpd_request_duration_seconds_count"):
        labels = {dict(items)["model"] for name, items in samples if name == family}
        assert labels <= MODEL_LABELS, (family, labels - MODEL_LABELS)


def test_a_class_no_config_has_makes_no_label_of_its_own(daemon):
    invented = 20
    with Client(daemon.endpoint, tenant="eve") as client:
        for i in range(invented):
            with pytest.raises(MCPDError) as refused:
                client.call("ping", {}, priority=f"made-up-{i}")
            assert refused.value.code == codes.BAD_REQUEST
    samples = wait_for(daemon, "mcpd_requests_total", invented, "the invented classes' refusals", tenant="eve",
                       code=codes.BAD_REQUEST, **{"class": UNKNOWN})
    for family in ("mcpd_requests_total", "mcpd_request_duration_seconds_count"):
        labels = {dict(items)["class"] for name, items in samples if name == family}
        assert labels <= CLASS_LABELS, (family, labels - CLASS_LABELS)


def test_queue_time_is_a_histogram_per_class(daemon):
    before = total(scrape(daemon), "mcpd_queue_time_seconds_count", **{"class": "low"})
    with daemon.client() as client:
        for i in range(3):
            client.infer("risk", {"features": features(1, 100 + i)}, priority="low")
    samples = wait_for(daemon, "mcpd_queue_time_seconds_count", before + 3, "3 more low-class requests queued",
                       **{"class": "low"})
    low = {items for name, items in samples if name == "mcpd_queue_time_seconds_bucket" and ("class", "low") in items}
    assert len(low) == len(LATENCY_BOUNDS) + 1   # and +Inf
    assert samples[("mcpd_queue_time_seconds_bucket", (("class", "low"), ("le", "+Inf")))] == before + 3


def test_handler_batches_rows_and_cache_are_labelled_with_the_model_version(daemon):
    risk = {"model": "risk", "version": "v1"}
    first = scrape(daemon)
    rows_before = total(first, "mcpd_handler_rows_total", **risk)
    misses_before = total(first, "mcpd_result_cache_misses_total", **risk)
    with daemon.client() as client:
        for i in range(5):
            client.infer("risk", {"features": features(2, 200 + i)})   # new inputs: each one a miss, 2 rows
    samples = wait_for(daemon, "mcpd_handler_rows_total", rows_before + 10, "the 10 rows run", **risk)
    assert total(samples, "mcpd_result_cache_misses_total", **risk) == misses_before + 5
    assert total(samples, "mcpd_handler_batches_total", **risk) >= 1
    assert 0 <= total(samples, "mcpd_handler_padding_ratio", **risk) < 1
