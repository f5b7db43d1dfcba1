"""The shipped handler examples through the real daemon, served from etc/examples/handlers.toml
itself: the classifier and the embedder over the ZeroMQ `infer` op answer as the same handler
run in-process, whatever texts of other lengths they are batched with; the int8 version answers and agrees with
the float model; the risk model's fast version (its rule table) answers `prefer_speed`
requests while their class is slow, the reply naming it."""
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from mcpd.daemon.scheduler.batching_window import ADJUST_EVERY
from mcpd.handlers.examples.risk_scorer import RiskRules, RiskScorer
from mcpd.handlers.examples.sentence_embedder import SentenceEmbedder
from mcpd.handlers.examples.text_classifier import TextClassifier
from mcpd.handlers.int8 import agreement
from test_handler_examples import MIN_TOP1_INT8, texts

EXAMPLES = Path(__file__).resolve().parent.parent / "etc" / "examples" / "handlers.toml"
SHIPPED = tomllib.loads(EXAMPLES.read_text())
# A class whose queueing p99 is over its fast_above_ms from its first measured requests (1 µs:
# every request waits longer), so the fast rung is entered without timing a real overload.
CLASSES = {"scheduler.classes.normal": {"rank": 1}, "scheduler.classes.hurry": {"rank": 2, "fast_above_ms": 0.001}}


def sections(table: dict, prefix: str = "") -> dict[str, dict]:
    """A TOML document's tables as Daemon's sections ({"models.risk.versions.v1": {...}}),
    inline tables (settings = {...}) as sections of their own."""
    found = {prefix: {k: v for k, v in table.items() if not isinstance(v, dict)}} if prefix else {}
    for key, value in table.items():
        if isinstance(value, dict):
            found.update(sections(value, f"{prefix}.{key}" if prefix else key))
    return found


@pytest.fixture(scope="module")
def daemon(module_daemon):
    d = module_daemon(**sections(SHIPPED), **CLASSES)
    d.wait_until(lambda: all(v.get("signature") for v in versions(d)), timeout=120,
                 what="every version's worker up (its Hello carries its signature)")
    return d


def versions(daemon) -> list[dict]:
    return [v for m in daemon.control("status")["models"]["models"].values() for v in m["versions"].values()]


def in_process(handler_class, model: str, version: str = "v1"):
    """The handler a version of the shipped file serves, set up here with its settings."""
    handler = handler_class()
    handler.setup("cpu", SHIPPED["models"][model]["versions"][version]["settings"])
    return handler


def run(handler, sample: np.ndarray) -> dict[str, np.ndarray]:
    return handler.predict(handler.preprocess({"text": sample}))


def test_status_shows_the_examples_signatures(daemon):
    models = daemon.control("status")["models"]["models"]
    assert models["classify"]["versions"]["v1"]["signature"] == {
        "inputs": {"text": {"datatype": "BYTES", "shape": [-1]}},
        "outputs": {"logits": {"datatype": "FP32", "shape": [-1, 4]}, "label": {"datatype": "INT64", "shape": [-1]}}}
    assert models["embed"]["versions"]["v1"]["signature"]["outputs"] == {
        "embedding": {"datatype": "FP32", "shape": [-1, 128]}}
    assert {v["kind"] for v in versions(daemon)} == {"handler"}


@pytest.mark.parametrize("model, handler_class, outputs", [
    ("classify", TextClassifier, ("logits", "label")), ("embed", SentenceEmbedder, ("embedding",))])
def test_concurrent_texts_answer_as_the_handler_in_process(daemon, model, handler_class, outputs):
    """Requests of 1..40 words (one of several rows) at once: whichever the worker batches
    together, padded to the longest, each gets what the handler gives its texts alone."""
    sample = texts(24, seed=5)
    requests = [sample[i:i + 1] for i in range(20)] + [sample[20:24]]
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda rows: daemon.client().infer(model, {"text": rows}), requests))
    expected = run(in_process(handler_class, model), sample)
    got = {name: np.concatenate([r.outputs[name] for r in replies]) for name in outputs}
    assert {(r.model, r.version) for r in replies} == {(model, "v1")}
    for name in outputs:
        assert got[name].dtype == expected[name].dtype
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-4, atol=1e-5)


def test_the_int8_version_answers_and_agrees_with_the_float_model(daemon, capsys):
    sample = texts(200, seed=6)
    reply = daemon.client().infer("classify", {"text": sample}, version="v1-int8")
    assert (reply.version, reply.outputs["logits"].shape) == ("v1-int8", (200, 4))
    reference = run(in_process(TextClassifier, "classify"), sample)["logits"]
    top1 = agreement(reference, reply.outputs["logits"], "top1")
    with capsys.disabled():
        print(f"\nint8 version through the daemon: top-1 agreement {top1:.3f} over 200 texts")
    assert top1 >= MIN_TOP1_INT8
    assert not np.array_equal(reply.outputs["logits"], reference)   # it is not the float model answering


def test_a_slow_class_sends_prefer_speed_requests_to_the_rules(daemon):
    features = np.random.default_rng(7).normal(size=(3, 256)).astype(np.float32)
    settings = SHIPPED["models"]["risk"]["versions"]
    scorer, rules = RiskScorer(), RiskRules()
    scorer.setup("cpu", settings["v1"]["settings"])
    rules.setup("cpu", settings["rules"]["settings"])
    client = daemon.client()
    for _ in range(ADJUST_EVERY):   # the class's window measures its p99 once per ADJUST_EVERY requests
        client.infer("risk", {"features": features}, priority="hurry")
    deadline = time.monotonic() + 60
    while "hurry" not in daemon.status()["scheduler"]["fast_rung"]["active"]:
        assert time.monotonic() < deadline, daemon.status()["scheduler"]["fast_rung"]
        client.infer("risk", {"features": features}, priority="hurry")
    fast = client.infer("risk", {"features": features}, priority="hurry", hints={"prefer_speed": True})
    assert fast.version == "rules"
    np.testing.assert_allclose(fast.outputs["score"], rules.predict({"features": features})["score"], rtol=1e-6)
    plain = client.infer("risk", {"features": features}, priority="hurry")
    assert plain.version == "v1"
    np.testing.assert_allclose(plain.outputs["score"], scorer.predict({"features": features})["score"], rtol=1e-5)
    assert client.infer("risk", {"features": features}, hints={"prefer_speed": True}).version == "v1"   # normal
    assert not np.allclose(fast.outputs["score"], plain.outputs["score"])
