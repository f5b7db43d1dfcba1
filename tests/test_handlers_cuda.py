"""The shipped handler examples on a GPU through the real daemon (skipped where torch sees none;
CI has none): every version's worker on cuda:0 answers as the same handler run in-process on the
CPU, requests alone and batched together, and a SIGKILLed worker's successor on the card answers
the same. bench/handlers.py --device cuda measures their batching there."""
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from mcpd.handlers.examples.risk_scorer import RiskScorer
from mcpd.handlers.examples.sentence_embedder import SentenceEmbedder
from mcpd.handlers.examples.text_classifier import TextClassifier
from test_handler_examples import texts
from test_handler_examples_daemon import SHIPPED, in_process, run, sections, versions

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (CI has none)")]

DEVICE = "cuda"
# float32 on the card against the CPU: the same products summed in another order (cuBLAS's tiles,
# the attention kernel torch picks there), a few float32 steps of a value, never a label's worth
RTOL, ATOL = 1e-3, 1e-4


@pytest.fixture(scope="module")
def daemon(module_daemon):
    d = module_daemon(**sections(SHIPPED), workers={"device": DEVICE})
    d.wait_until(lambda: all(v.get("signature") for v in versions(d)), timeout=300,
                 what="every version's worker up on the card")
    return d


def test_every_worker_runs_on_the_card(daemon):
    devices = daemon.status()["devices"]
    assert len(devices) == sum(len(model["versions"]) for model in SHIPPED["models"].values())
    assert {d["device"] for d in devices} == {f"{DEVICE}:0"}


def _texts_answered(daemon, model: str, handler_class, outputs: tuple[str, ...]) -> None:
    """24 texts sent as 21 requests at once answer as the handler gives them alone, on the CPU."""
    sample = texts(24, seed=5)
    requests = [sample[i:i + 1] for i in range(20)] + [sample[20:24]]
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda rows: daemon.client().infer(model, {"text": rows}), requests))
    expected = run(in_process(handler_class, model), sample)
    for name in outputs:
        got = np.concatenate([r.outputs[name] for r in replies])
        assert got.dtype == expected[name].dtype
        if name == "label":   # an argmax: compared where the top two logits are apart
            logits = np.sort(expected["logits"], axis=1)
            clear = logits[:, -1] - logits[:, -2] > 10 * ATOL
            assert clear.sum() >= len(clear) // 2 and np.array_equal(got[clear], expected[name][clear])
        else:
            np.testing.assert_allclose(got, expected[name], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("model, handler_class, outputs", [
    ("classify", TextClassifier, ("logits", "label")), ("embed", SentenceEmbedder, ("embedding",))])
def test_texts_answer_as_the_handler_on_the_cpu(daemon, model, handler_class, outputs):
    _texts_answered(daemon, model, handler_class, outputs)


def test_scores_answer_as_the_handler_on_the_cpu_and_after_a_kill(daemon):
    features = np.random.default_rng(3).normal(size=(40, 256)).astype(np.float32)
    expected = in_process(RiskScorer, "risk").predict({"features": features})["score"]
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda i: daemon.client().infer("risk", {"features": features[i:i + 4]}),
                                range(0, 40, 4)))
    np.testing.assert_allclose(np.concatenate([r.outputs["score"] for r in replies]), expected, rtol=RTOL, atol=ATOL)

    index = next(d["worker"] for d in daemon.status()["devices"] if (d["served_model"], d["version"]) == ("risk", "v1"))
    old = daemon.pid_of("worker", index)
    os.kill(old, signal.SIGKILL)
    daemon.wait_until(lambda: daemon.status()["state"] == "ready" and daemon.pid_of("worker", index) != old
                      and all(v.get("signature") for v in versions(daemon)), 180, "the risk worker's successor")
    again = daemon.client().infer("risk", {"features": features})
    np.testing.assert_allclose(again.outputs["score"], expected, rtol=RTOL, atol=ATOL)
    _texts_answered(daemon, "classify", TextClassifier, ("logits", "label"))
