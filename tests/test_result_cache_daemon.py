"""The handlers' result cache through the real daemon: the same inputs asked again are answered
from the cache, never for another tenant or another version; `cache: false` neither reads nor
fills it; a warm-up file's inputs are cached before the first request; the hit rate shows in
status and /metrics; a warm-up file that cannot be read refuses the start."""
import os
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mcpd.handlers.examples.risk_scorer import RiskScorer
from mcpd.handlers.tensors import encode
from mcpd.handlers.warmup_file import WarmInput, write_warmup

SCORER = "mcpd.handlers.examples.risk_scorer:RiskScorer"
WARM_SEED = 1000


def features(seed: int, rows: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, 256)).astype(np.float32)


def scores(seed: int, x: np.ndarray) -> np.ndarray:
    handler = RiskScorer()
    handler.setup("cpu", {"seed": seed})
    return handler.predict({"features": x})["score"]


@pytest.fixture(scope="module")
def d(module_daemon, tmp_path_factory):
    warm = tmp_path_factory.mktemp("warm") / "risk.msgpack"
    header, frame = encode("features", features(WARM_SEED))
    write_warmup(str(warm), [WarmInput("default", (header,), (frame,))])
    cache = {"max_bytes": 1 << 20}
    return module_daemon(**{
        "pool": {"shared": False}, "metrics": {"listen": "127.0.0.1:0"},
        "models.risk": {"default": "v1"},
        "models.risk.versions.v1": {"handler": SCORER}, "models.risk.versions.v1.settings": {"seed": 3},
        "models.risk.versions.v1.cache": {**cache, "warmup": str(warm)},
        "models.risk.versions.v2": {"handler": SCORER}, "models.risk.versions.v2.settings": {"seed": 7},
        "models.risk.versions.v2.cache": cache,
    })


def test_the_same_inputs_again_are_answered_from_the_cache(d):
    client, x = d.client(), features(1)
    first = client.infer("risk", {"features": x}, version="v1")
    again = client.infer("risk", {"features": x}, version="v1")
    assert not first.cached and again.cached and again.version == "v1"
    np.testing.assert_array_equal(again.outputs["score"], first.outputs["score"])
    np.testing.assert_allclose(first.outputs["score"], scores(3, x), rtol=1e-5)


def test_another_tenants_identical_request_is_not_answered_from_the_cache(d):
    x = features(2)
    assert not d.client(tenant="alice").infer("risk", {"features": x}, version="v1").cached
    assert not d.client(tenant="bob").infer("risk", {"features": x}, version="v1").cached
    assert d.client(tenant="bob").infer("risk", {"features": x}, version="v1").cached


def test_another_versions_identical_request_is_not_answered_from_the_cache(d):
    client, x = d.client(), features(3)
    assert not client.infer("risk", {"features": x}, version="v1").cached
    other = client.infer("risk", {"features": x}, version="v2")
    assert not other.cached and other.version == "v2"
    np.testing.assert_allclose(other.outputs["score"], scores(7, x), rtol=1e-5)
    assert client.infer("risk", {"features": x}, version="v1").cached   # v1's result was there all along


def test_cache_false_neither_reads_nor_fills_the_cache(d):
    client, x = d.client(), features(4)
    assert not client.infer("risk", {"features": x}, version="v1", cache=False).cached
    assert not client.infer("risk", {"features": x}, version="v1").cached
    assert not client.infer("risk", {"features": x}, version="v1", cache=False).cached
    assert client.infer("risk", {"features": x}, version="v1").cached


def test_a_warmup_files_inputs_are_cached_before_the_first_request(d):
    x = features(WARM_SEED)
    warm = d.client().infer("risk", {"features": x}, version="v1")
    assert warm.cached
    np.testing.assert_allclose(warm.outputs["score"], scores(3, x), rtol=1e-5)
    assert not d.client(tenant="alice").infer("risk", {"features": x}, version="v1").cached


def scrape(d) -> dict:
    with urllib.request.urlopen(d.status()["metrics"], timeout=30) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_hit_rate_shows_in_status_and_metrics(d):
    client, x = d.client(), features(5)
    for _ in range(4):
        client.infer("risk", {"features": x}, version="v2")
    figures = {}

    def counted() -> bool:
        figures.update(d.status()["models"]["models"]["risk"]["versions"]["v2"].get("result_cache") or {})
        return figures.get("hits", 0) >= 3
    d.wait_until(counted, 30, "v2's cache hits in status")
    assert figures["entries"] >= 1 and 0 < figures["hit_rate"] == figures["hits"] / (figures["hits"] + figures["misses"])
    samples = scrape(d)
    v2 = {name: value for (name, labels), value in samples.items()
          if name.startswith("mcpd_result_cache_") and ("version", "v2") in labels}
    assert v2["mcpd_result_cache_hits_total"] >= 3 and v2["mcpd_result_cache_entries"] >= 1
    assert 0 < v2["mcpd_result_cache_hit_ratio"] <= 1


@pytest.mark.parametrize("make, says", [
    (lambda path: None, "[Errno 2] No such file or directory"),
    (os.mkfifo, "not a regular file"),   # opened without waiting for a writer: the start never hangs on it
])
def test_a_warmup_file_that_cannot_be_read_refuses_the_start(fresh_daemon, tmp_path, make, says):
    warmup = tmp_path / "warm.msgpack"
    make(warmup)
    daemon = fresh_daemon(started=False, **{
        "pool": {"shared": False}, "models.risk": {}, "models.risk.versions.v1": {"handler": SCORER},
        "models.risk.versions.v1.cache": {"max_bytes": 1 << 20, "warmup": str(warmup)}})
    daemon.start(wait=False)
    assert daemon.process.wait(120) == 2
    assert f"cache warmup file {warmup}: {says}" in daemon.log()
